"""lazy-init-locks: two read-modify-writes of process state that torch does without a lock.

* ``torch._functorch.predispatch.lazy_load_decompositions`` (torch 2.9+; every first ``torch.vmap``, and eager
  flex attention) registers vmap's decompositions once, under ``DECOMPOSITIONS_LOCK``, a lock it makes on first
  use: ``if DECOMPOSITIONS_LOCK is None: DECOMPOSITIONS_LOCK = threading.Lock()``, itself unlocked. Two threads'
  first calls can each make a lock of their own and both register: on torch 2.9 - 2.12 the second raises
  ``RuntimeError: This is not allowed since there's already a kernel registered from python overriding ...``; on
  2.13+, which allows the override, the second thread's kernels replace the first's (a warning). (2.2 - 2.8 made
  the lock at import; 2.0 - 2.1 take no lock, and set the flag before registering.)
* ``torch._higher_order_ops.invoke_leaf_function.store_makefx_modules`` (torch 2.12+; a ``leaf_function`` called
  with modules under ``make_fx``, so a non-strict export) gives each module an index from a process-wide counter,
  ``_makefx_next_index -= 1``, then reads the counter again to file the module under it. Two threads that
  interleave there get one index for two modules, and the graph of one runs the other's module. The indices are
  baked into the traced graphs, so the counter must stay one for the process: it gets a lock, not a copy per
  thread.

The edits: the lock ``lazy_load_decompositions`` makes is one made ahead of time (``_torchfix_decompositions_lock``),
so every thread takes the same one; and the decrement, with the read of the index it gives, runs under
``_torchfix_makefx_index_lock``.
"""

from __future__ import annotations

import ast
import importlib
import sys
import threading
import types
from collections.abc import Callable

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result, hold, line_of, started_thread, stopping
from ..patching.patches import SourcePatch
from ..patching.source import Edit, ShapeError, definition, find_replaced, replace_node, segment

PREDISPATCH = "torch._functorch.predispatch"
LEAF = "torch._higher_order_ops.invoke_leaf_function"
DECOMPOSITIONS_LOCK = "_torchfix_decompositions_lock"
INDEX_LOCK = "_torchfix_makefx_index_lock"
COUNTER = "_makefx_next_index"


class _DecompositionsLock(SourcePatch):
    """``lazy_load_decompositions`` takes a lock made once, whichever thread makes "its" lock first."""

    def __init__(self) -> None:
        super().__init__(PREDISPATCH, "torch/_functorch/predispatch.py")

    def describe(self) -> str:
        return super().describe() + f"; adds {DECOMPOSITIONS_LOCK}, the one lock every thread's first call takes"

    def edits(self, source: str) -> list[Edit]:
        (made,) = find_replaced(
            self.relpath,
            definition(source, self.relpath, "lazy_load_decompositions"),
            "`DECOMPOSITIONS_LOCK = threading.Lock()` in lazy_load_decompositions",
            lambda node: (
                isinstance(node, ast.Assign)
                and [segment(source, target) for target in node.targets] == ["DECOMPOSITIONS_LOCK"]
                and segment(source, node.value) == "threading.Lock()"
            ),
        )
        return [replace_node(made.value, DECOMPOSITIONS_LOCK)]

    def helpers(self) -> dict[str, object]:
        return {DECOMPOSITIONS_LOCK: threading.Lock()}


class _IndexLock(SourcePatch):
    """``store_makefx_modules`` decrements the counter and reads the index it gives under one lock."""

    def __init__(self) -> None:
        super().__init__(LEAF, "torch/_higher_order_ops/invoke_leaf_function.py")

    def describe(self) -> str:
        return super().describe() + f"; adds {INDEX_LOCK}, held while a module's index is taken from {COUNTER}"

    def edits(self, source: str) -> list[Edit]:
        function = definition(source, self.relpath, "store_makefx_modules")
        uses = [node for node in ast.walk(function) if isinstance(node, ast.Name) and node.id == COUNTER]
        decrements = [
            node
            for node in ast.walk(function)
            if isinstance(node, ast.AugAssign) and segment(source, node) == f"{COUNTER} -= 1"
        ]
        reads = [use for use in uses if isinstance(use.ctx, ast.Load)]
        if len(decrements) != 1 or len(uses) != 3 or len(reads) != 2:
            raise ShapeError(f"{self.relpath}: store_makefx_modules is not `{COUNTER} -= 1` and two reads of it")
        locked = f"with {INDEX_LOCK}: {COUNTER} -= 1; index = {COUNTER}"
        return [replace_node(decrements[0], locked)] + [replace_node(read, "index") for read in reads]

    def helpers(self) -> dict[str, object]:
        return {INDEX_LOCK: threading.Lock()}


def _patches(torch_version: str) -> list[SourcePatch]:
    return [_DecompositionsLock()] + ([_IndexLock()] if torch_version in releases("2.12") else [])


def _probe() -> str | None:
    try:
        predispatch = importlib.import_module(PREDISPATCH)
    except ImportError:
        predispatch = None
    if not hasattr(predispatch, "DECOMPOSITIONS_LOCK"):
        return f"no {PREDISPATCH}.DECOMPOSITIONS_LOCK made on first use (torch 2.9+)"
    if DECOMPOSITIONS_LOCK in vars(predispatch):
        return "the locks are in already"
    return None


def first_vmap_calls(timeout: float = 60.0) -> Result | None:
    """Two threads' first ``torch.vmap`` calls of the process. A has seen no decompositions lock and is about to
    make one; B then makes its own lock, takes it and, inside, is about to register the decompositions; A goes on
    (with the fix it waits for B's lock: then B is let go first). Without the fix both register. None before torch
    2.9, or where vmap has run in this process already."""
    import torch

    predispatch = sys.modules.get(PREDISPATCH)
    if predispatch is None or "DECOMPOSITIONS_LOCK" not in vars(predispatch) or predispatch.DECOMPOSITIONS_LOADED:
        return None
    load = predispatch.lazy_load_decompositions
    make_lock, take_lock = line_of(load, "DECOMPOSITIONS_LOCK = "), line_of(load, "with DECOMPOSITIONS_LOCK")
    register = line_of(load, "from torch._decomp import decomposition_table")  # after the Library is made
    a_saw_none, a_goes, a_on, b_inside, b_goes = (threading.Event() for _ in range(5))
    registered: list[str] = []
    errors: dict[str, str] = {}

    def a_takes_lock(frame: types.FrameType) -> None:
        if frame.f_globals["DECOMPOSITIONS_LOCK"].locked():  # B's lock: A will wait for it, so B must go on
            a_on.set()

    def b_registers(frame: types.FrameType) -> None:
        registered.append("B")
        hold(b_inside, b_goes, timeout)(frame)

    def vmap(stops: dict[int, Callable[[types.FrameType], None]]) -> Callable[[], object]:
        return lambda: stopping(load, stops, lambda: torch.vmap(torch.sin)(torch.ones(2, 2)))

    a_stops = {make_lock: hold(a_saw_none, a_goes, timeout), take_lock: a_takes_lock}
    a = started_thread("A", vmap({**a_stops, register: lambda _frame: registered.append("A")}), a_on, errors)
    a_saw_none.wait(timeout)
    b = started_thread("B", vmap({register: b_registers}), b_inside, errors)
    b_inside.wait(timeout)
    a_goes.set()
    a_on.wait(timeout)  # A registered and ended, or waits for B's lock
    b_goes.set()
    a.join(timeout)
    b.join(timeout)
    detail = f"{len(registered)} thread(s) registered the vmap decompositions ({', '.join(registered)})"
    detail += "".join(f"; {name} raised {error[:200]}" for name, error in sorted(errors.items()))
    return Result("first vmap calls (two threads)", len(registered) > 1, detail)


def leaf_module_indices(timeout: float = 60.0) -> Result | None:
    """Two threads file a module each for the make_fx path of ``leaf_function`` (``store_makefx_modules``, which
    a non-strict export of a leaf function taking a module calls). A has taken its index from the counter; B takes
    one too; then A files its module, then B. Each thread's index must give back its own module. None before
    torch 2.12."""
    import torch

    try:
        leaf = importlib.import_module(LEAF)
    except ImportError:
        return None
    store = getattr(leaf, "store_makefx_modules", None)
    if store is None:
        return None
    file_it = line_of(store, "_makefx_module_storage[")  # the line after the decrement
    taken = {name: threading.Event() for name in "AB"}
    goes = {name: threading.Event() for name in "AB"}
    modules = {name: torch.nn.Identity() for name in "AB"}
    indices: dict[str, tuple[int, ...]] = {}
    errors: dict[str, str] = {}

    def thread(name: str) -> threading.Thread:
        def target() -> None:
            stops = {file_it: hold(taken[name], goes[name], timeout)}
            indices[name] = stopping(store, stops, lambda: store([modules[name]]))

        return started_thread(name, target, taken[name], errors)

    a = thread("A")
    taken["A"].wait(timeout)
    b = thread("B")
    taken["B"].wait(timeout)
    goes["A"].set()
    a.join(timeout)
    goes["B"].set()
    b.join(timeout)
    scenario = "leaf-function module indices (two threads)"
    if errors:
        return Result(scenario, True, "; ".join(f"{name} raised {error}" for name, error in errors.items()))
    got = {name: leaf._retrieve_module_by_index(index) for name, (index,) in indices.items()}
    wrong = [name for name, module in got.items() if module is not modules[name]]
    detail = f"indices {indices['A']} and {indices['B']}" + "".join(
        f"; thread {name}'s index gives thread {'B' if name == 'A' else 'A'}'s module" for name in wrong
    )
    return Result(scenario, bool(wrong), detail)


FIX = Fix(
    name="lazy-init-locks",
    order=380,
    hazard="two threads' first torch.vmap calls both register vmap's decompositions (torch 2.9 - 2.12: "
    "RuntimeError); two make_fx traces of leaf functions give two modules one index (the wrong module runs)",
    versions=releases("2.9"),
    probe=_probe,
    patches=_patches,
    scenarios=(
        Scenario(
            leaf_module_indices,
            releases("2.12"),
            needs="torch._higher_order_ops.invoke_leaf_function (2.12+)",
            shows="index gives thread",
        ),
        # Stage 1: it needs the process's first vmap call, so it runs once per process (not among the repeated
        # stage-0 scenarios of the uninstall test).
        Scenario(
            first_vmap_calls,
            releases("2.9"),
            needs="a first vmap call (torch 2.9+)",
            shows="2 thread(s) registered",
            stage=1,
        ),
    ),
    shared_state=(
        "two read-modify-writes of process state that torch does unlocked: "
        "`torch._functorch.predispatch.lazy_load_decompositions` makes its `DECOMPOSITIONS_LOCK` on first use, "
        "without a lock, and `invoke_leaf_function.store_makefx_modules` (a `leaf_function` taking modules, under"
        " `make_fx` or a non-strict export) takes each module's index from a process counter with `-= 1` and then"
        " reads the counter again"
    ),
    symptom=(
        "two threads' first `torch.vmap` calls each make a lock and both register vmap's decompositions: on 2.9 –"
        " 2.12 the second raises `RuntimeError: This is not allowed since there's already a kernel registered "
        "from python overriding mse_loss_backward's behavior` (torch 2.10), from 2.13 it overrides the first's "
        "kernels; two threads filing modules at once get one index for both, and one thread's graph runs the "
        "other's module (torch 2.13, 2.15). The lock is now one made ahead of time, and the index is taken under "
        "a lock (a per-thread counter would be wrong: the indices are baked into graphs)"
    ),
    releases_note='the index from 2.12; 2.2 – 2.8 make the lock at import: "not needed"',
    survey_rows=(
        "torch/_functorch/predispatch.py: DECOMPOSITIONS_LOADED",
        "torch/_functorch/predispatch.py: DECOMPOSITIONS_LOCK",
        "torch/_functorch/predispatch.py: VMAP_DECOMPOSITIONS_LIB",
        "torch/_higher_order_ops/invoke_leaf_function.py: _makefx_next_index",
    ),
)
