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
from .._patch import moved_globals_fix

STACK = "_mode_stack_state_for_pre_dispatch"

FIX = moved_globals_fix(
    "pre-dispatch-modes",
    "while one thread exports (pre-dispatch tracing), eager torch.cond in another thread traces into its graph and "
    "breaks the export; two exports pop each other's modes",
    "2.3",
    "torch._ops",
    "_pre_dispatch_tls",
    {STACK: "mode_stack"},
    own=frozenset({STACK}),
    scenarios=(
        Scenario(
            "pre_dispatch_elsewhere",
            releases("2.4"),  # torch.export.export pushes onto the stack from 2.4 (2.3: only make_fx pre_dispatch)
            needs="a pre-dispatch mode stack and non-strict export",
            shows="modes on the main thread's stack: 1;",
            stage=2,
        ),
    ),
)
