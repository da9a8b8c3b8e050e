"""parametrize-cached: ``torch.nn.utils.parametrize.cached()`` caches for the thread inside it only.

``cached()`` counts its entries in the module global ``_cache_enabled`` and keeps the cached parametrized tensors in
the global ``_cache`` (keyed by module id and tensor name); at the last exit it drops the cache. The property that
``register_parametrization`` injects reads both on every access of a parametrized tensor. As process globals
(every release, 2.0 - 2.15): while one thread is inside ``cached()`` (the RNN loop its docstring shows), every
other thread's parametrized tensors are cached too, so a second training step of another thread's module reads the
weight computed (and freed by backward) in its first: "RuntimeError: Trying to backward through the graph a second
time" (2.13, 2.15); and a thread's ``cached()`` that ends while another's is open drops the other's cache, where
the last one out clears it.

Both globals move to per-thread storage (``parametrize._cached_tls``, :class:`ThreadLocalGlobals`); each thread
gets its own cache dict. A backward can read them: a forward recomputed there (``torch.utils.checkpoint``) reads
the parametrized weight, and on autograd's device thread (CUDA) it sees the values of the thread whose backward it
runs, as torch's globals are seen there (``seen_in_backward=True``; before 2.13 the device thread sees the
defaults: no cache, the weight computed again, the same value).
"""

from __future__ import annotations

import threading

from .._fix import Scenario, releases
from ..doctor.scenarios import Result
from ..patching.patches import moved_globals_fix

MODULE = "torch.nn.utils.parametrize"


def _two_steps() -> str | None:
    """Two SGD steps of a fresh ``nn.Linear`` whose weight is parametrized: None where they run, else the error."""
    import torch
    import torch.nn.utils.parametrize as P

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 3)
    P.register_parametrization(layer, "weight", Double())
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        try:
            layer(torch.ones(2, 3)).sum().backward()
        except RuntimeError as error:
            return f"raised RuntimeError: {str(error)[:60]}"
        opt.step()
    return None


def cached_elsewhere(timeout: float = 60.0) -> Result | None:
    """Thread A enters ``parametrize.cached()`` and waits inside; the main thread, outside any ``cached()``, trains
    two steps of its own parametrized module: both must run, and A must still be inside its cache."""
    import torch.nn.utils.parametrize as P

    entered, leave, seen = threading.Event(), threading.Event(), {}

    def inside() -> None:
        with P.cached():
            entered.set()
            leave.wait(timeout)
            seen["A at its end, caching"] = bool(P._cache_enabled)

    thread = threading.Thread(target=inside, name="torchfix-selftest", daemon=True)
    thread.start()
    entered.wait(timeout)
    seen["the main thread's two steps"] = _two_steps() or "ran"
    leave.set()
    thread.join(timeout)
    hazard = seen != {"the main thread's two steps": "ran", "A at its end, caching": True}
    detail = "; ".join(f"{where}: {value}" for where, value in seen.items())
    return Result("parametrize.cached() in another thread (training steps meanwhile)", hazard, detail)


FIX = moved_globals_fix(
    "parametrize-cached",
    "while one thread is inside parametrize.cached(), every thread's parametrized tensors are cached: another "
    "thread's second training step raises 'Trying to backward through the graph a second time'",
    "2.0",
    MODULE,
    "_cached_tls",
    {"_cache_enabled": "cache_enabled", "_cache": "cache"},
    order=352,
    seen_in_backward=True,
    trigger=MODULE,
    scenarios=(
        Scenario(
            cached_elsewhere,
            releases("2.0"),
            shows="the main thread's two steps: raised RuntimeError: Trying to backward through the graph a second",
        ),
    ),
    shared_state=(
        "`torch.nn.utils.parametrize._cache_enabled` (how many `cached()` contexts are open) and `_cache` (the "
        "parametrized tensors computed inside, by module id and name): written by `cached()`, read by the property "
        "of every parametrized tensor (`register_parametrization`)"
    ),
    symptom=(
        "while one thread is inside `cached()`, another thread's second training step of its own parametrized "
        "module raises 'Trying to backward through the graph a second time' (2.13, 2.15, forced with events, 1 of "
        "1 run each; its scenario: 3 of 3 runs on 2.13 and 2.15, 2 of 2 on 2.14.1 and 1 of 1 on 2.2 without the fix, "
        "none with it); a `cached()` that ends while another thread's is open drops that one's cache"
    ),
    releases_note="every release, 2.0 - 2.15: the same two globals",
    survey_rows=("torch/nn/utils/parametrize.py: _cache_enabled, _cache",),
)
