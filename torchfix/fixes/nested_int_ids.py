"""nested-int-ids: a jagged nested tensor's nested int is taken from torch's counter in one step, never shared.

``torch.nested._internal.nested_tensor.get_tensor_symint`` (torch 2.2+) gives the offsets (or lengths) of a jagged
nested tensor the ragged size it is known by, a nested int ``j<N>``, kept in ``_tensor_symint_registry``: it reads
the module global ``_tensor_id_counter``, makes the nested int from it and only then bumps it, unlocked. Two nested
ints with one ``N`` are one size to torch. So (2.13, forced with a line-trace hook, no sleeps): while thread A stands
between its read and its bump, thread B makes a nested tensor of other offsets through the same read, and both
tensors are ``(2, j1, 3)``: ``A + B`` runs (on 2.13) where torch must raise that their ragged sizes differ.

The read becomes ``_torchfix_take_tensor_id()``, which reads and bumps the global under a lock, and the bump
``pass``: each call takes an id of its own. The global keeps torch's values (FakeTensorMode reads it by module
attribute); in one thread the ids, the nested ints and the counter after are torch's.

Not covered: two threads making nested tensors of the very same offsets tensor at once can each find it unregistered
and make two nested ints, the last registered winning: the other thread's tensor then does not match later tensors
of those offsets, and torch raises (loud, as where two offsets are really different), as without torchfix.
"""

from __future__ import annotations

import ast
import importlib
import threading

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result, hold, line_of, started_thread, stopping, torch_module
from ..patching.patches import SourcePatch, source_without_import
from ..patching.source import Edit, definition, find_replaced, replace_node

MODULE = "torch.nested._internal.nested_tensor"
RELPATH = "torch/nested/_internal/nested_tensor.py"
FUNCTION, COUNTER = "get_tensor_symint", "_tensor_id_counter"
HELPER = "_torchfix_take_tensor_id"
BUMP = f"{COUNTER} += 1"


class _TakeId:
    """``HELPER()``: the counter's value, the counter bumped in the same step (under a lock)."""

    def __init__(self) -> None:
        self._namespace = vars(importlib.import_module(MODULE))
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            taken = self._namespace[COUNTER]
            self._namespace[COUNTER] = taken + 1
        return taken


class _OneStepIds(SourcePatch):
    """In ``get_tensor_symint``: the counter's read becomes ``HELPER()``, its bump ``pass``."""

    def __init__(self) -> None:
        super().__init__(MODULE, RELPATH)

    def describe(self) -> str:
        return super().describe() + f"; adds {HELPER} (takes an id and bumps {COUNTER} under a lock)"

    def edits(self, source: str) -> list[Edit]:
        function = definition(source, self.relpath, FUNCTION)
        (read,) = find_replaced(
            self.relpath,
            function,
            f"read of {COUNTER}",
            lambda n: isinstance(n, ast.Name) and n.id == COUNTER and isinstance(n.ctx, ast.Load),
        )
        (bump,) = find_replaced(
            self.relpath,
            function,
            f"bump of {COUNTER}",
            lambda n: isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name) and n.target.id == COUNTER,
        )
        return [replace_node(read, f"{HELPER}()"), replace_node(bump, "pass")]

    def helpers(self) -> dict[str, object]:
        return {HELPER: _TakeId()}


def _probe() -> str | None:
    source = source_without_import(MODULE)
    if source is None or f"def {FUNCTION}(" not in source:
        return f"torch has no {MODULE}.{FUNCTION} (before 2.2)"
    module = torch_module(MODULE)
    if HELPER in vars(module):
        return f"{MODULE}.{FUNCTION} takes its ids in one step already"
    return None


def shared_nested_int(timeout: float = 60.0) -> Result | None:
    """Thread A makes a jagged nested tensor of two rows (2 and 3 long) and is held in ``get_tensor_symint`` at the
    counter's bump (a line-trace hook, torch untouched); the main thread makes one of two rows 1 and 4 long; A goes
    on. The two ragged sizes must differ. None before torch 2.2."""
    nested = torch_module(MODULE)
    if nested is None or not hasattr(nested, FUNCTION):
        return None
    import torch

    def jagged(*rows: int):
        return nested.jagged_from_list([torch.ones(n, 3) for n in rows], None)[0]

    jagged(1, 1)  # the first nested tensor makes torch's own dummy one too: held here, it would be that one's
    function = getattr(nested, FUNCTION)
    reached, release, ended, errors, made = threading.Event(), threading.Event(), threading.Event(), {}, {}
    stops = {line_of(function, BUMP): hold(reached, release, timeout)}
    a = started_thread("A", lambda: made.update(A=stopping(function, stops, lambda: jagged(2, 3))), ended, errors)
    try:
        if not reached.wait(timeout):
            return Result("nested ints of two threads", True, f"A never reached the bump: {errors or 'timeout'}")
        made["B"] = jagged(1, 4)
    finally:
        release.set()
        a.join(timeout)
    if errors:
        return Result("nested ints of two threads", True, f"A raised {errors['A']}")
    sizes = {name: str(tensor.shape[1]) for name, tensor in made.items()}
    shared = sizes["A"] == sizes["B"]
    try:
        made["A"] + made["B"]
        added = "A + B ran"
    except RuntimeError:
        added = "A + B raised"
    detail = f"A's ragged size {sizes['A']}, B's {sizes['B']}" + (f" (one nested int: {added})" if shared else "")
    return Result("jagged nested tensors of two threads at once (A held between its read and bump)", shared, detail)


FIX = Fix(
    name="nested-int-ids",
    order=357,
    hazard="two threads making jagged nested tensors at once can take one nested int (j<N>) for different offsets: "
    "torch then takes their ragged sizes for equal",
    versions=releases("2.2"),
    probe=_probe,
    patches=lambda _torch_version: [_OneStepIds()],
    trigger=MODULE,
    scenarios=(
        Scenario(
            shared_nested_int,
            releases("2.2"),
            needs=f"{MODULE}.{FUNCTION} (2.2+)",
            shows="one nested int",
        ),
    ),
    shared_state=f"{MODULE}.{COUNTER}: read by {FUNCTION} to make a jagged tensor's nested int, bumped after it "
    "(unlocked); FakeTensorMode reads it as its first nested-int id",
    symptom="a thread held between the counter's read and its bump, another thread's nested tensor of other offsets "
    "got the same nested int, and A + B ran (2.13, 2.14.1, 2.15, forced with a line-trace hook); its scenario: 5 of 5 "
    "runs on 2.13, 3 of 3 on 2.14.1 and 2.15 without the fix, none with it",
    releases_note='2.2 - 2.15 (no jagged nested tensors before 2.2: "not needed")',
    caveats="the counter is bumped before the nested int is made (an id is spent if making it raises); two threads "
    "making nested tensors of one offsets tensor at once can still make two nested ints for it (torch raises later)",
    survey_rows=("torch/nested/_internal/nested_tensor.py: _tensor_id_counter",),
)
