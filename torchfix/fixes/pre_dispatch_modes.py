"""pre-dispatch-modes: the modes pre-dispatch tracing pushes belong to the thread that traces.

Pre-dispatch tracing (non-strict ``torch.export.export``, ``make_fx(pre_dispatch=True)``) pushes its proxy
and functional modes onto a stack of torch's own, ``torch._ops._mode_stack_state_for_pre_dispatch``: one
object for the process (torch 2.3+), while the dispatch key that routes ops to it is in C++ thread-local
state. So while one thread exports, every other thread sees the exporter's modes on "its" stack: an eager
higher-order op there (``torch.cond``, eager flex attention) finds the exporter's proxy mode and traces into
the other thread's graph, which then fails ("fake mode ... doesn't match mode", "parent_tracer.fx_tracer
should not be None"), and two exports pop each other's modes ("Trying to pop empty mode stack",
"ProxyTorchDispatchMode slot already occupied"). Still so in 2.15.

Every thread gets a stack of its own (``_ops._pre_dispatch_tls``), made on its first use; torch reads the
stack only through ``mode_stack_state_for_pre_dispatch()``, so one moved global covers it.
"""

from __future__ import annotations

from .._fix import Scenario, releases
from ..doctor.scenarios import HeldExport, Result, export_never_held
from ..patching.patches import moved_globals_fix

STACK = "_mode_stack_state_for_pre_dispatch"


def pre_dispatch_elsewhere(timeout: float = 60.0) -> Result | None:
    """While thread A is inside a non-strict ``torch.export.export`` (pre-dispatch tracing, its forward
    waiting there), the main thread counts the modes on its pre-dispatch stack and runs ``torch.cond``
    eagerly; then A's export goes on. The main thread's stack must be empty, its ``torch.cond`` must run, and
    A must export. None where this torch has no pre-dispatch mode stack or no non-strict export."""
    import torch

    if not hasattr(torch._ops, "_len_torch_dispatch_stack_pre_dispatch") or not hasattr(torch, "cond"):
        return None
    scenario = "pre-dispatch modes (eager torch.cond in one thread while another exports)"
    with HeldExport(timeout) as held:
        if not held.inside:
            return export_never_held(held, scenario)
        modes = torch._ops._len_torch_dispatch_stack_pre_dispatch()
        try:
            torch.cond(torch.tensor(True), lambda x: x.sin(), lambda x: x.cos(), (torch.ones(2),))
            cond = "ran"
        except Exception as exc:
            cond = f"raised {type(exc).__name__}: {str(exc)[:200]}"
    wrong = modes != 0 or cond != "ran" or held.outcome.startswith(("raised", "no answer"))
    detail = f"modes on the main thread's stack: {modes}; its torch.cond {cond}; the held export: {held.outcome[:300]}"
    return Result(scenario, wrong, detail)


FIX = moved_globals_fix(
    "pre-dispatch-modes",
    "while one thread exports (pre-dispatch tracing), eager torch.cond in another thread traces into its graph and "
    "breaks the export; two exports pop each other's modes",
    "2.3",
    "torch._ops",
    "_pre_dispatch_tls",
    {STACK: "mode_stack"},
    order=130,
    own=frozenset({STACK}),
    scenarios=(
        Scenario(
            pre_dispatch_elsewhere,
            releases("2.4"),  # torch.export.export pushes onto the stack from 2.4 (2.3: only make_fx pre_dispatch)
            needs="a pre-dispatch mode stack and non-strict export",
            shows="modes on the main thread's stack: 1;",
            stage=2,
        ),
    ),
    shared_state=(
        "`torch._ops._mode_stack_state_for_pre_dispatch`, the stack of modes pre-dispatch tracing (non-strict "
        "`torch.export.export`, `make_fx(pre_dispatch=True)`) pushes, is one object for the process, while the "
        "dispatch key that routes ops to it is per thread"
    ),
    symptom=(
        "while one thread exports, every other thread sees the exporter's modes: an eager `torch.cond` there "
        'traces into the export, which fails ("fake mode ... doesn\'t match mode"), and after that every eager '
        "`torch.cond` in the process raises `UncapturedHigherOrderOpError`; two exports pop each other's modes "
        '("Trying to pop empty mode stack")'
    ),
    releases_note=(
        'before 2.3: "not needed"; `torch.export.export` traces pre-dispatch from 2.4, on 2.3 only '
        "`make_fx(pre_dispatch=True)` uses the stack"
    ),
    seen_in_backward=True,
    survey_rows=("torch/_ops.py: _mode_stack_state_for_pre_dispatch",),
)
