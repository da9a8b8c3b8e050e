"""make-fx-tracer: the make_fx trace in progress belongs to the thread that traces.

``torch.fx.experimental.proxy_tensor`` keeps the make_fx tracer at work in one module global,
``_CURRENT_MAKE_FX_TRACER`` (torch 2.4+), which ``make_fx`` sets for its trace and restores after it, and from
which higher-order ops (``torch.cond``, ``while_loop``, flex attention's score and mask functions) trace their
subgraphs. Two threads tracing at once (a compile's AOTAutograd in one, an export in another) share it: when
the first to start finishes, it restores the value it found, and the other thread's ``torch.cond`` then
raises "Cannot reenter make_fx when we're not under a make_fx tracing session" or traces into the wrong
graph; when that one finishes in turn, it leaves the first one's finished tracer behind for every later
higher-order op. Still a global in 2.15.

The global moves to per-thread storage (``proxy_tensor._make_fx_tracer_tls``) with
:class:`ThreadLocalGlobals`.
"""

from __future__ import annotations

import threading

from .._fix import Scenario, releases
from ..doctor.scenarios import HeldTrace, Result
from ..patching.patches import moved_globals_fix


def make_fx_tracer_elsewhere(timeout: float = 60.0) -> Result | None:
    """Thread A holds a ``make_fx`` trace open; thread B starts one of a function with ``torch.cond`` and
    waits inside it; A finishes; then B's ``torch.cond`` traces. B must trace the cond with its own tracer,
    and no tracer may be left behind once both are done. None where torch has no make_fx tracer global
    (before 2.4)."""
    import torch
    from torch.fx.experimental import proxy_tensor

    if not hasattr(proxy_tensor, "_set_make_fx_tracer") or not hasattr(torch, "cond"):
        return None
    inside, go_on = threading.Event(), threading.Event()
    problems: list[str] = []

    def with_cond(x):
        inside.set()
        go_on.wait(timeout)
        return torch.cond(x.sum() > 0, lambda y: y.sin(), lambda y: y.cos(), (x,))

    def trace() -> None:
        try:
            ops = [node.target for node in proxy_tensor.make_fx(with_cond)(torch.ones(2)).graph.nodes]
            if torch.ops.higher_order.cond not in ops:
                problems.append(f"B's graph has no cond: {ops}")
        except Exception as exc:
            problems.append(f"B raised {type(exc).__name__}: {str(exc)[:200]}")

    held = HeldTrace("make_fx", timeout).__enter__()
    b = threading.Thread(target=trace, name="torchfix-selftest", daemon=True)
    b.start()
    inside.wait(timeout)
    held.__exit__(RuntimeError, None, None)  # A finishes while B traces; its errors are collected here
    problems += [f"A raised {exc!r}" for exc in held.errors]
    go_on.set()
    b.join(timeout)
    if getattr(proxy_tensor, "_CURRENT_MAKE_FX_TRACER", None) is not None:
        problems.append("a finished tracer was left behind")
    detail = "; ".join(problems) or "both traced"
    return Result("make_fx tracer (two threads tracing with make_fx at once)", bool(problems), detail)


FIX = moved_globals_fix(
    "make-fx-tracer",
    "two threads tracing with make_fx at once: one's torch.cond loses its tracer ('Cannot reenter make_fx') or "
    "traces into the other's graph, and a finished tracer is left behind",
    "2.4",
    "torch.fx.experimental.proxy_tensor",
    "_make_fx_tracer_tls",
    {"_CURRENT_MAKE_FX_TRACER": "tracer"},
    order=150,
    scenarios=(
        Scenario(
            make_fx_tracer_elsewhere,
            releases("2.4"),
            needs="a make_fx tracer global (2.4+)",
            shows="Cannot reenter",
            crashes=releases("2.10", "2.11"),  # FakeTensorMode.__enter__ segfaults when threads make_fx at once
            stage=1,  # without the fix, a finished tracer is left behind in the process
        ),
    ),
    shared_state=(
        "`torch.fx.experimental.proxy_tensor._CURRENT_MAKE_FX_TRACER`, the make_fx trace in progress, from which "
        "higher-order ops trace their subgraphs, is a process global that every `make_fx` (every AOTAutograd "
        "compile, every export) sets and restores"
    ),
    symptom=(
        "of two threads tracing at once, the one still tracing loses its tracer when the other finishes: its "
        '`torch.cond` raises "Cannot reenter make_fx when we\'re not under a make_fx tracing session" (or traces '
        "into the other graph), and a finished tracer is left behind for every later higher-order op"
    ),
    releases_note='before 2.4: "not needed"',
    seen_in_backward=True,
    survey_rows=("torch/fx/experimental/proxy_tensor.py: _CURRENT_MAKE_FX_TRACER",),
)
