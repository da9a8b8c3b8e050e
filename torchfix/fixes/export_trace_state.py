"""export-trace-state: the module an export is tracing belongs to the thread that exports it.

``torch.export._trace`` keeps what the export in progress is about in module globals: ``_EXPORT_FLAGS``
(strict or not, for its logs; torch 2.3+) and ``_EXPORT_MODULE_HIERARCHY`` (the exported module's
submodules, from which the program's module call graph is built; 2.4+). ``torch.export.export`` sets them
at its start and clears them when it returns. Two threads exporting at once share them: the first to
finish clears them under the other, whose export then fails with ``AssertionError:
_EXPORT_MODULE_HIERARCHY must not be None``, or, while both run, the later export's hierarchy replaces the
earlier's and that program gets the other module's call graph. Globals in every release up to 2.15.

Both move to per-thread storage (``_trace._export_trace_tls``) with :class:`ThreadLocalGlobals`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from .._fix import Scenario, SoakCheck, releases
from ..doctor.scenarios import HeldExport, Result, export_call_graph, export_never_held
from ..patching.patches import moved_globals_fix

MODULE = "torch.export._trace"


def export_trace_elsewhere(timeout: float = 60.0) -> Result | None:
    """While thread A is inside ``torch.export.export`` (non-strict: its module's forward runs, and waits
    there), the main thread exports another module from start to end; then A's export goes on. Both must
    export, each with its own module call graph. None where this torch cannot export non-strict."""
    import torch

    if not hasattr(getattr(torch, "export", None), "export"):
        return None
    scenario = "export trace (torch.export.export in two threads at once)"

    class Other(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.other = torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.other(x)

    with HeldExport(timeout) as held:
        if not held.inside:
            return export_never_held(held, scenario)
        mine = export_call_graph(Other())
    theirs = held.outcome
    # Wrong: an export failed, or its call graph names the other thread's module.
    wrong = any(graph.startswith(("raised", "no answer")) for graph in (mine, theirs))
    wrong = wrong or "held" in mine.split(",") or "other" in theirs.split(",")
    detail = f"module call graphs: the main thread's {mine!r}, the held thread's {theirs!r}"
    return Result(scenario, wrong, detail)


def soak_leak_probe() -> Callable[[bool], bool]:
    """Whether the calling thread sees ``_EXPORT_MODULE_HIERARCHY`` set (by another thread's torch.export.export)."""
    return lambda at_end: getattr(sys.modules.get(MODULE), "_EXPORT_MODULE_HIERARCHY", None) is not None


FIX = moved_globals_fix(
    "export-trace-state",
    "torch.export.export in two threads at once: one raises AssertionError: _EXPORT_MODULE_HIERARCHY must not be "
    "None when the other finishes, or gets the other module's call graph",
    "2.3",
    MODULE,
    "_export_trace_tls",
    {"_EXPORT_FLAGS": "flags", "_EXPORT_MODULE_HIERARCHY": "module_hierarchy"},
    order=120,
    optional=frozenset({"_EXPORT_MODULE_HIERARCHY"}),
    trigger=MODULE,
    scenarios=(Scenario(export_trace_elsewhere, releases("2.4"), needs="non-strict export", stage=3),),
    shared_state=(
        "`torch.export._trace._EXPORT_MODULE_HIERARCHY` (the exported module's submodules, from which the "
        "program's module call graph is built; 2.4+) and `_EXPORT_FLAGS` (2.3+) are process globals that every "
        "`torch.export.export` sets at its start and clears at its end"
    ),
    symptom=(
        "`torch.export.export` in two threads at once: when one finishes, the other raises `AssertionError: "
        "_EXPORT_MODULE_HIERARCHY must not be None` (torch 2.13: 3 of 3 runs of the self-test), or builds its "
        "call graph from the other module"
    ),
    releases_note='before 2.3: "not needed"',
    seen_in_backward=True,
    soak=SoakCheck(errors=("_EXPORT_MODULE_HIERARCHY",), leak_probe=soak_leak_probe),
    survey_rows=(
        "torch/export/_trace.py: _EXPORT_FLAGS",
        "torch/export/_trace.py: _EXPORT_MODULE_HIERARCHY",
    ),
)
