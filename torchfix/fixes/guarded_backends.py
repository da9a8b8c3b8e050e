"""guarded-backends: on torch 2.2, code compiled in one thread passes its guards in every thread.

Dynamo 2.2 guards each compiled entry of a frame with ``___current_backend() == ___lookup_backend(id)``,
and ``___lookup_backend`` reads ``eval_frame.guarded_backend_cache.cached_backends``, a dict of the backends
compiled with, kept in a ``threading.local``. A thread that never compiled with a backend has no entry for
it: once a frame holds code compiled by one ``torch.compile`` (an ``eager`` one in the main thread, say), a
call in another thread through another ``torch.compile`` of the same frame raises ``KeyError`` from the guard
instead of recompiling (torch.cond compiles its branches on every eager call, so it meets this often: 237
failed calls in a 4-second soak). torch 2.3 made ``cached_backends`` one module dict.

The holder object is swapped for one whose ``current_backend`` and run-only flag stay per thread (they are
per compiled region) and whose ``cached_backends`` is one dict for the process, as in 2.3. Filling it is a
dict store (atomic under the GIL), and ``torch._dynamo.reset()`` replaces it for every thread. Code compiled
before ``import torchfix`` in another thread than the importing one keeps its per-thread entry out of reach.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result, in_thread
from ..patching.defaults import _DefaultChange
from ..patching.source import ShapeError

MODULE = "torch._dynamo.eval_frame"
HOLDER = "guarded_backend_cache"
PER_THREAD = ("current_backend", "skip_backend_check_for_run_only_mode")


class _SharedBackends(threading.local):
    """``guarded_backend_cache`` with one ``cached_backends`` for every thread."""

    backends: dict[int, object] = {}  # replaced on apply; a class attribute, so the same in every thread

    @property
    def cached_backends(self) -> dict[int, object]:
        return type(self).backends

    @cached_backends.setter
    def cached_backends(self, value: dict[int, object]) -> None:  # torch._dynamo.reset(): for every thread
        type(self).backends = value


class _ShareCachedBackends(_DefaultChange):
    def __init__(self) -> None:
        self.module_name = MODULE
        self._original: threading.local | None = None

    def describe(self) -> str:
        return f"{MODULE}.{HOLDER}: cached_backends one dict for all threads (the holder object swapped)"

    def apply(self) -> None:
        module = importlib.import_module(MODULE)
        original = getattr(module, HOLDER, None)
        if type(original) is not threading.local:
            raise ShapeError(f"{MODULE}.{HOLDER} is not a threading.local")
        shared = _SharedBackends()
        # The importing thread's entries carry over, so what it compiled before keeps passing its guards.
        _SharedBackends.backends = dict(getattr(original, "cached_backends", {}))
        for name in PER_THREAD:
            if hasattr(original, name):
                setattr(shared, name, getattr(original, name))
        self._original = original
        setattr(module, HOLDER, shared)

    def revert(self) -> None:
        if self._original is None:
            return
        module = importlib.import_module(MODULE)
        shared = getattr(module, HOLDER)
        # What was compiled while applied keeps passing its guards, in this thread at least.
        self._original.cached_backends = {**getattr(self._original, "cached_backends", {}), **shared.cached_backends}
        setattr(module, HOLDER, self._original)
        self._original = None

    def verify(self) -> None:
        holder = getattr(importlib.import_module(MODULE), HOLDER)
        seen: list[object] = []
        thread = threading.Thread(target=lambda: seen.append(holder.cached_backends), name="torchfix-verify")
        thread.start()
        thread.join()
        if not seen or seen[0] is not holder.cached_backends:
            raise ShapeError(f"{MODULE}.{HOLDER}.cached_backends is not shared with a new thread")


def _probe() -> str | None:
    module = importlib.import_module(MODULE)
    if hasattr(module, "cached_backends"):
        return "Dynamo keeps the backends its guards look up in one module dict (torch 2.3+)"
    if type(getattr(module, HOLDER, None)) is not threading.local:
        return f"{MODULE} has no per-thread {HOLDER} (Dynamo before 2.2 guards no backend)"
    return None


def guarded_backends_elsewhere(timeout: float = 60.0) -> Result:
    """The main thread compiles a function; a new thread compiles and calls it with another
    ``torch.compile`` (another backend object): the call must run, not fail the first compile's guard with
    ``KeyError`` (torch 2.2 keeps the backends guards look up per thread)."""
    import torch

    def triple(x):
        return x * 3

    def backend() -> Callable:
        return lambda gm, example_inputs: gm.forward  # a new object each time: guards tell them apart

    torch.compile(triple, backend=backend())(torch.ones(2))
    outcome = in_thread(lambda: torch.compile(triple, backend=backend())(torch.ones(2)), timeout)
    failed = isinstance(outcome, BaseException)
    detail = f"raised {type(outcome).__name__}: {outcome}" if failed else "ran"
    return Result("guarded backends (compiled in one thread, compiled again and called in another)", failed, detail)


FIX = Fix(
    name="guarded-backends",
    order=70,
    hazard="code compiled in one thread fails its guard with KeyError in another thread that compiled the same "
    "function with another torch.compile (torch 2.2)",
    versions=releases("2.2", "2.2"),
    probe=_probe,
    patches=lambda _torch_version: [_ShareCachedBackends()],
    trigger=MODULE,
    scenarios=(Scenario(guarded_backends_elsewhere, releases("2.2", "2.2"), shows="KeyError"),),
    shared_state=(
        "Dynamo 2.2 keeps the backends its guards look up "
        "(`torch._dynamo.eval_frame.guarded_backend_cache.cached_backends`) in a `threading.local`; 2.3 made it "
        "one module dict"
    ),
    symptom=(
        "once a function holds code compiled by one `torch.compile`, a call in another thread through another "
        "`torch.compile` of it raises `KeyError` from the guard instead of compiling (eager `torch.cond` compiles"
        " its branches on every call: 237 failed calls in a 4-second soak)"
    ),
    releases_note='2.1 guards no backend, 2.3+ share it: "not needed"',
)
