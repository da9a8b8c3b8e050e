"""make-fx-tracer: the make_fx trace in progress belongs to the thread that traces.

``torch.fx.experimental.proxy_tensor`` keeps the make_fx tracer at work in one module global,
``_CURRENT_MAKE_FX_TRACER`` (torch 2.4+), which ``make_fx`` sets for its trace and restores after it, and from
which higher-order ops (``torch.cond``, ``while_loop``, flex attention's score and mask functions) trace their
subgraphs. Two threads tracing at once (a compile's AOTAutograd in one, an export in another) share it: when
the first to start finishes, it restores the value it found, and the other thread's ``torch.cond`` then
raises "Cannot reenter make_fx when we're not under a make_fx tracing session" or traces into the wrong
graph; when that one finishes in turn, it leaves the first one's finished tracer behind for every later
higher-order op. Still a global in 2.15.

The global moves to a ``threading.local`` (``proxy_tensor._make_fx_tracer_tls``) with
:class:`ThreadLocalGlobals`.
"""

from __future__ import annotations

from .._fix import Scenario, releases
from .._patch import moved_globals_fix

FIX = moved_globals_fix(
    "make-fx-tracer",
    "two threads tracing with make_fx at once: one's torch.cond loses its tracer ('Cannot reenter make_fx') or "
    "traces into the other's graph, and a finished tracer is left behind",
    "2.4",
    "torch.fx.experimental.proxy_tensor",
    "_make_fx_tracer_tls",
    {"_CURRENT_MAKE_FX_TRACER": "tracer"},
    scenarios=(
        Scenario(
            "make_fx_tracer_elsewhere",
            releases("2.4"),
            needs="a make_fx tracer global (2.4+)",
            shows="Cannot reenter",
            crashes=releases("2.10", "2.11"),  # FakeTensorMode.__enter__ segfaults when threads make_fx at once
            stage=1,  # without the fix, a finished tracer is left behind in the process
        ),
    ),
)
