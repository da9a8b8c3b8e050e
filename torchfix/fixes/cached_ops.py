"""cached-ops: ``torch._ops.get_cached_ops()`` hands out a copy, not the live set.

``torch._ops.cached_ops`` is a process-wide set of every operator overload whose dispatch a call has cached
(``add_cached_op``, on the first call of an overload in any thread). Entering a pre-dispatch mode (every
non-strict ``torch.export.export``, ``make_fx(pre_dispatch=True)``) iterates ``get_cached_ops()`` to drop those
caches (``torch.utils._python_dispatch._push_mode``). ``get_cached_ops`` returns the set itself, so when
another thread calls an overload for the first time meanwhile, the export raises ``RuntimeError: Set changed
size during iteration`` (the 10-minute soak on torch 2.13 with every other fix on: once). Still so in 2.15.

``get_cached_ops`` returns ``set(cached_ops)`` instead: a copy made in one step under the GIL, which the
caller iterates in peace. An overload that another thread caches just after the copy was made is not
uncached by that mode push, as it would not have been had it come a moment later.
"""

from __future__ import annotations

import ast
import importlib

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result, in_thread
from ..patching.patches import SourcePatch
from ..patching.source import Edit, ShapeError, definitions, replace_node

MODULE = "torch._ops"
FUNCTION, CACHE = "get_cached_ops", "cached_ops"


class _CopyOfCachedOps(SourcePatch):
    def __init__(self) -> None:
        super().__init__(MODULE, "torch/_ops.py")

    def describe(self) -> str:
        return super().describe() + f"; {FUNCTION}() returns set({CACHE})"

    def edits(self, source: str) -> list[Edit]:
        function = definitions(source).get(FUNCTION)
        returns = [node for node in ast.walk(function) if isinstance(node, ast.Return)] if function else []
        if len(returns) != 1 or not (isinstance(returns[0].value, ast.Name) and returns[0].value.id == CACHE):
            raise ShapeError(f"{self.relpath}: {FUNCTION} is not `return {CACHE}`")
        return [replace_node(returns[0].value, f"set({CACHE})")]


def _probe() -> str | None:
    module = importlib.import_module(MODULE)
    get = getattr(module, FUNCTION, None)
    if get is None:
        return f"{MODULE} has no {FUNCTION} (before torch 2.1)"
    return None if get() is getattr(module, CACHE, None) else f"{MODULE}.{FUNCTION}() returns a copy already"


def cached_ops_elsewhere(timeout: float = 60.0) -> Result | None:
    """The main thread iterates ``torch._ops.get_cached_ops()``, as entering a pre-dispatch mode (an export)
    does; halfway, another thread caches an operator overload's dispatch for the first time
    (``add_cached_op``). The iteration must finish. None before torch 2.1."""
    import torch
    from torch import _ops

    if not hasattr(_ops, "get_cached_ops"):
        return None
    aten = torch.ops.aten
    for op in (aten.sin.default, aten.cos.default):  # at least two, so that the iteration has a halfway
        _ops.add_cached_op(op)
    candidates = (aten.tan.default, aten.atan.default, aten.sinh.default, aten.cosh.default, aten.tanh.default)
    fresh = next((op for op in candidates if op not in _ops.cached_ops), None)
    if fresh is None:
        return Result("cached ops", False, "every candidate operator is cached already: nothing to add")
    ops = iter(_ops.get_cached_ops())
    next(ops)
    in_thread(lambda: _ops.add_cached_op(fresh), timeout)
    try:
        rest = sum(1 for _ in ops)
    except RuntimeError as exc:
        return Result("cached ops (iterated in one thread, added to in another)", True, f"raised {exc}")
    return Result("cached ops (iterated in one thread, added to in another)", False, f"iterated {rest + 1} ops")


FIX = Fix(
    name="cached-ops",
    order=140,
    hazard="an export (a pre-dispatch mode push) iterates torch._ops' process-wide set of cached operators while "
    "other threads add to it: RuntimeError: Set changed size during iteration",
    versions=releases("2.1"),
    probe=_probe,
    patches=lambda _torch_version: [_CopyOfCachedOps()],
    scenarios=(
        Scenario(
            cached_ops_elsewhere, releases("2.1"), needs="torch._ops.get_cached_ops (2.1+)", shows="Set changed size"
        ),
    ),
    shared_state=(
        "`torch._ops.get_cached_ops()` returns the live process-wide set `cached_ops`, which every operator "
        "overload joins when its dispatch is first cached (in any thread) and every pre-dispatch mode push "
        "(non-strict `torch.export.export`, `make_fx(pre_dispatch=True)`) iterates"
    ),
    symptom=(
        "an export raises `RuntimeError: Set changed size during iteration` when another thread calls an overload"
        " for the first time meanwhile (the 10-minute soak on 2.13: once); `get_cached_ops()` now returns a copy"
    ),
    releases_note='no such set before 2.1: "not needed"',
    survey_rows=("torch/_ops.py: cached_ops",),
)
