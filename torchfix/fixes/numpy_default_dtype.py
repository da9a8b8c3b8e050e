"""numpy-default-dtype: ``torch._numpy``'s switch of the default dtype is counted, never left changed.

``torch._numpy._util._coerce_to_tensor`` (torch 2.2+; ``torch._numpy.array`` / ``asarray`` of Python data, which is
what Dynamo traces ``np.array([...])`` through) saves ``torch.get_default_dtype()``, sets NumPy's default float
dtype (float64), converts and, in its ``finally``, sets the saved value again. The default dtype is one C++ setting
of the process. So (2.13, forced with events): two threads converting at once, the first in leaving first, leave
the process's default dtype float64 for good (the second saved the first's float64), and every later
``torch.ones(1)`` of every thread is float64; and a ``torch.set_default_dtype`` made by another thread during a
conversion is undone at its end.

The switch goes through :mod:`torchfix.patching.switches` instead (an ``Override`` of the default dtype): overlapping
conversions are counted, so exits in any order leave the default as it was before the first; an exit writes back
only a default that still holds the value the conversion set, so another thread's setting made meanwhile stays.
In one thread this is torch's behaviour (nothing inside the conversion sets the default dtype).

What stays out of reach: while a thread converts, every thread's default dtype is float64 (a C++ process setting;
torch offers no per-thread default): another thread's ``torch.ones(1)`` in that window is float64, as without
torchfix. Passing the dtype to the conversion instead is not the same: ``torch.as_tensor`` infers a dtype from the
data (ints, bools, complex) that only the default may steer. The override does not yield to other threads'
compiles (the converting thread needs the value while it traces).
"""

from __future__ import annotations

import ast
import threading

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result, hold, line_of, stopping, torch_module
from ..patching.patches import SourcePatch
from ..patching.source import Edit, ShapeError, definition, find_replaced, replace_node, segment
from ..patching.switches import Override, Switch

MODULE = "torch._numpy._util"
RELPATH = "torch/_numpy/_util.py"
FUNCTION = "_coerce_to_tensor"
HELPER, OVERRIDE = "_torchfix_default_dtype", "_torchfix_dtype_override"
CONVERSION = "tensor = _try_convert_to_tensor(obj)"


class _DefaultDtype:
    """``HELPER(dtype)``: an entered, counted override of the process's default dtype."""

    def __init__(self) -> None:
        import torch

        self._switch = Switch("default dtype", torch.get_default_dtype, torch.set_default_dtype)

    def __call__(self, dtype: object) -> Override:
        return Override(lambda: {self._switch: dtype}, yields_to_compiles=False).enter()


class _CountedDefault(SourcePatch):
    """In ``_coerce_to_tensor``: the set of NumPy's default becomes an entered override, the restore in the
    ``finally`` its exit."""

    def __init__(self) -> None:
        super().__init__(MODULE, RELPATH)

    def describe(self) -> str:
        return super().describe() + f"; adds {HELPER} (a counted override of the default dtype)"

    def edits(self, source: str) -> list[Edit]:
        function = definition(source, self.relpath, FUNCTION)
        sets = find_replaced(
            self.relpath,
            function,
            "set and restore of the default dtype",
            lambda n: isinstance(n, ast.Expr) and segment(source, n).startswith("torch.set_default_dtype("),
            count=2,
        )
        setting, restoring = sets
        restored = any(isinstance(n, ast.Try) and restoring in n.finalbody for n in ast.walk(function))
        if not restored or segment(source, restoring) != "torch.set_default_dtype(default_dtype)":
            raise ShapeError(f"{self.relpath}: {FUNCTION} does not restore the default dtype in a finally")
        value = segment(source, setting.value.args[0])
        return [
            replace_node(setting, f"{OVERRIDE} = {HELPER}({value})"),
            replace_node(restoring, f"{OVERRIDE}.exit()"),
        ]

    def helpers(self) -> dict[str, object]:
        return {HELPER: _DefaultDtype()}


def _probe() -> str | None:
    util = torch_module(MODULE)
    if util is None:
        return f"torch has no {MODULE} (before 2.1)"
    if HELPER in vars(util):
        return f"{MODULE}.{FUNCTION}'s default dtype is counted already"
    if "set_default_dtype" not in getattr(util, FUNCTION).__code__.co_names:
        return f"{MODULE}.{FUNCTION} leaves the default dtype alone (2.1)"
    return None


def overlapping_conversions(timeout: float = 60.0) -> Result | None:
    """Threads A and B each convert a Python list with ``torch._numpy.asarray``, held at the conversion (a
    line-trace hook, torch untouched); A is released first, then B. Both arrays must be float64 and the default
    dtype afterwards what it was (it is set back at the end either way)."""
    import torch

    util = torch_module(MODULE)
    if util is None or {"set_default_dtype", HELPER}.isdisjoint(getattr(util, FUNCTION).__code__.co_names):
        return None  # 2.1: the conversion leaves the default alone
    import torch._numpy as tnp

    line = line_of(getattr(util, FUNCTION), CONVERSION)
    before, seen = torch.get_default_dtype(), {}
    reached = {name: threading.Event() for name in "AB"}
    release = {name: threading.Event() for name in "AB"}

    def convert(name: str) -> None:
        try:
            array = stopping(
                getattr(util, FUNCTION),
                {line: hold(reached[name], release[name], timeout)},
                lambda: tnp.asarray([1.5, 2.5]),
            )
            seen[f"{name}'s array"] = str(array.tensor.dtype)
        finally:
            reached[name].set()

    threads = {name: threading.Thread(target=convert, args=(name,), name=f"torchfix-selftest-{name}") for name in "AB"}
    try:
        threads["A"].start()
        reached["A"].wait(timeout)
        threads["B"].start()
        reached["B"].wait(timeout)
        release["A"].set()
        threads["A"].join(timeout)
        release["B"].set()
        threads["B"].join(timeout)
        seen["default dtype after"] = str(torch.get_default_dtype())
    finally:
        torch.set_default_dtype(before)
    own = str(torch.float64)
    hazard = seen != {"A's array": own, "B's array": own, "default dtype after": str(before)}
    detail = "; ".join(f"{where}: {value}" for where, value in seen.items())
    return Result("torch._numpy conversions in two threads (the first in leaving first)", hazard, detail)


FIX = Fix(
    name="numpy-default-dtype",
    order=353,
    hazard="torch._numpy's conversion of Python data sets the process's default dtype to float64 and back: two "
    "overlapping conversions leave it float64 for good; another thread's set_default_dtype meanwhile is undone",
    versions=releases("2.2"),
    probe=_probe,
    patches=lambda _torch_version: [_CountedDefault()],
    trigger=MODULE,
    scenarios=(
        Scenario(
            overlapping_conversions,
            releases("2.2"),
            needs=f"{MODULE}.{FUNCTION} switching the default dtype (2.2+)",
            shows="default dtype after: torch.float64",
        ),
    ),
    shared_state="the process's default dtype (C++, torch.set_default_dtype): saved, set to NumPy's default float "
    "dtype and restored by torch._numpy._util._coerce_to_tensor (torch._numpy.array / asarray of Python data, "
    "Dynamo's tracing of np.array); read by every tensor factory of every thread",
    symptom="two threads converting at once, the first in leaving first: the default dtype stays float64 for good "
    "(every later torch.ones(1) float64); while a thread converts, another thread's torch.ones(1) is float64 "
    "(2.13, forced with a line-trace hook); its scenario: 3 of 3 runs on 2.13 and 2.15, 2 of 2 on 2.14.1 and 1 of 1 "
    "on 2.2 without the fix, none with it",
    releases_note='before 2.2: "not needed" (2.1 converts otherwise); 2.2 - 2.15 the same lines',
    caveats="out of reach: while a thread converts, every thread's default dtype is NumPy's (float64), as in "
    "torch; a default dtype set by another thread during a conversion now stays",
    survey_rows=("torch/_numpy/_util.py: the default dtype (C++ process setting)",),
)
