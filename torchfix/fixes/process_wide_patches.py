"""process-wide-patches: what torch patches for one trace while it works acts only in the thread that traces.

Two pieces of torch write into a class or module while they run, process-wide, and write the
originals back at their end:

* ``torch._higher_order_ops.torchbind.enable_torchbind_tracing()`` (torch 2.3+; nothing in torch enters it, users
  exporting models with torchbind objects do) sets ``torch.ScriptMethod.__call__`` to ``torchbind_method_redispatch``,
  which routes a torchbind object's method calls (``__torch__.torch.classes...``) through the ``call_torchbind``
  higher-order operator. While one thread is inside, every thread's torchbind calls go there: under a
  ``TorchDispatchMode`` of its own (a logging or FLOP-counting mode) another thread's plain ``packed.bias()`` raises
  ``NotImplementedError: There was no rule registered for HigherOrderOperator call_torchbind`` (reproduced on torch
  2.10, 2.13 and 2.15; by the code an ``AssertionError`` on 2.3 – 2.4, which send every ``ScriptObject``'s methods
  there, TorchScript modules' too), and when one of two threads inside it leaves, the other's calls stop being
  traced as torchbind calls;
* ``torch.fx.experimental.meta_tracer.MetaTracer.trace`` (2.0+, a legacy tracer) sets ``torch.arange``, ``zeros``,
  ``ones``, ``full_like`` and ``eye`` to wrappers, by ``setattr(torch, ...)``. Every thread's calls go through them,
  and two traces that overlap restore out of order: the second wraps the first one's wrappers and finally puts
  those back, so ``torch.zeros`` and the rest stay the first tracer's wrappers for the process.

The writes go through a ``ThreadPatches`` in each module (``_thread_patches``; ``patching/slots.py``, the
per-thread dispatcher of trace-patch-isolation): each thread patches for itself, other threads run the originals,
and the last thread to leave restores them; the meta tracer's read of the function to wrap is the calling thread's
view. ``enable_torchbind_tracing()`` also appends ``torch.ScriptObject`` to AOTAutograd's ``KNOWN_TYPES`` and pops
it at its end: left as it is, since every thread appends the same type (the pop's check holds whatever the order)
and the list only widens which inputs AOTAutograd accepts.
"""

from __future__ import annotations

import importlib
import threading
import warnings
from collections.abc import Callable

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result
from ..patching.patches import source_without_import
from ..patching.slots import HELPER, SlotPatches

TORCHBIND, META_TRACER = "torch._higher_order_ops.torchbind", "torch.fx.experimental.meta_tracer"
CONSTRUCTORS = ("arange", "zeros", "ones", "full_like", "eye")  # MetaTracer._TORCH_METHODS_TO_PATCH


def _patches(_torch_version: str) -> list[SlotPatches]:
    return [
        SlotPatches(TORCHBIND, "enable_torchbind_tracing", "torch.ScriptMethod", "__call__", reads=0),  # 2.3+
        SlotPatches(META_TRACER, "MetaTracer.trace", "torch", None, reads=1),  # setattr(torch, name, ...)
    ]


def _probe() -> str | None:
    present = [name for name in (TORCHBIND, META_TRACER) if source_without_import(name) is not None]
    if not present:
        return "torch has neither enable_torchbind_tracing nor the meta tracer"
    if all(HELPER in vars(importlib.import_module(name)) for name in present):
        return "their patches are per-thread already"
    return None


def _packed_linear() -> object | None:
    """A torchbind object every CPU build has (``LinearPackedParamsBase``), or None."""
    import torch

    with warnings.catch_warnings():  # 2.13+: quantized tensors are deprecated
        warnings.simplefilter("ignore")
        try:
            weight = torch.quantize_per_tensor(torch.ones(2, 2), 0.1, 0, torch.qint8)
            return torch.ops.quantized.linear_prepack(weight, torch.ones(2))
        except Exception:
            return None


class _Held:
    """A thread running ``work(hold)``; ``hold()`` waits there until :meth:`end` (the constructor returns once the
    thread is there). What it raised is in ``errors``."""

    def __init__(self, work: Callable[[Callable[[], None]], object], timeout: float) -> None:
        self.timeout, self.inside, self.release, self.errors = timeout, threading.Event(), threading.Event(), []
        self.thread = threading.Thread(target=self._run, args=(work,), name="torchfix-selftest", daemon=True)
        self.thread.start()
        self.inside.wait(timeout)

    def _hold(self) -> None:
        self.inside.set()
        self.release.wait(self.timeout)

    def _run(self, work: Callable[[Callable[[], None]], object]) -> None:
        try:
            work(self._hold)
        except Exception as exc:
            self.errors.append(exc)
        finally:
            self.inside.set()

    def end(self) -> None:
        self.release.set()
        self.thread.join(self.timeout)


def torchbind_call_elsewhere(timeout: float = 60.0) -> Result | None:
    """While thread A is inside ``enable_torchbind_tracing()``, the main thread calls a torchbind method
    (``LinearPackedParamsBase.bias()``) under a ``TorchDispatchMode`` of its own: it must return the bias, as it
    does alone. None where torch has no ``enable_torchbind_tracing`` (before 2.3) or no quantized linear."""
    import torch

    torchbind = importlib.import_module(TORCHBIND) if source_without_import(TORCHBIND) else None
    packed = _packed_linear()
    if not hasattr(torchbind, "enable_torchbind_tracing") or packed is None:
        return None
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def inside(hold: Callable[[], None]) -> None:
        with torchbind.enable_torchbind_tracing():
            hold()

    held = _Held(inside, timeout)
    try:
        with Passthrough():
            mine = f"returned {packed.bias().tolist()}"
    except Exception as exc:
        mine = f"raised {type(exc).__name__}: {(str(exc).splitlines() or [''])[0].split(' and mode')[0]}"
    finally:
        held.end()
    left = torch.ScriptMethod.__call__ is not torchbind._orig_scriptmethod_call
    detail = f"the main thread's packed.bias() under its dispatch mode {mine}"
    detail += "; left patched: torch.ScriptMethod.__call__" if left else ""
    detail += "".join(f"; the thread inside raised {exc!r}" for exc in held.errors)
    hazard = not mine.startswith("returned") or left or bool(held.errors)
    return Result(
        "torchbind tracing (enable_torchbind_tracing() in one thread, a torchbind call in another)", hazard, detail
    )


def overlapping_meta_traces(timeout: float = 60.0) -> Result | None:
    """Threads A and B each ``meta_tracer.symbolic_trace`` a module; B starts while A traces, and A finishes first.
    Both must trace, and afterwards ``torch.zeros`` and the other constructors must be torch's own again."""
    import torch

    meta_tracer = importlib.import_module(META_TRACER)
    originals = {name: getattr(torch, name) for name in CONSTRUCTORS}

    class Held(torch.nn.Module):
        def __init__(self, hold: Callable[[], None]) -> None:
            super().__init__()
            self.hold = hold

        def forward(self, x):
            self.hold()
            return x * 2

    def trace(hold: Callable[[], None]) -> None:
        meta_tracer.symbolic_trace(Held(hold), meta_args={"x": torch.zeros(2, device="meta")})

    traces = [_Held(trace, timeout), _Held(trace, timeout)]
    for held in traces:  # A finishes first
        held.end()
    left = [name for name, original in originals.items() if getattr(torch, name) is not original]
    for name in left:  # put torch back for the scenarios after this one
        setattr(torch, name, originals[name])
    errors = [f"a trace raised {exc!r}" for held in traces for exc in held.errors]
    problems = errors + ([f"left patched: torch.{', torch.'.join(left)}"] if left else [])
    return Result(
        "meta tracer (two threads' MetaTracer traces overlapping)", bool(problems), "; ".join(problems) or "ok"
    )


FIX = Fix(
    name="process-wide-patches",
    order=390,
    hazard="while one thread is inside enable_torchbind_tracing() or a MetaTracer trace, every thread runs its "
    "patches (torch.ScriptMethod.__call__, torch.zeros and other constructors); overlapping ones restore out of order",
    versions=releases("2.0"),
    probe=_probe,
    patches=_patches,
    scenarios=(
        Scenario(
            torchbind_call_elsewhere,
            releases("2.3"),
            needs="enable_torchbind_tracing (2.3+) and quantized linear",
            shows="under its dispatch mode raised",
        ),
        Scenario(overlapping_meta_traces, releases("2.0"), shows="left patched: torch.arange", stage=1),
    ),
    shared_state=(
        "`torch._higher_order_ops.torchbind.enable_torchbind_tracing()` (2.3+) sets "
        "`torch.ScriptMethod.__call__`, and the legacy `torch.fx.experimental.meta_tracer.MetaTracer.trace` sets "
        "`torch.arange`, `zeros`, `ones`, `full_like` and `eye` (`setattr(torch, ...)`), for the whole process "
        "while they last, and write the originals back at their end"
    ),
    symptom=(
        "while one thread is inside `enable_torchbind_tracing()`, a torchbind method call in another thread goes "
        "through the `call_torchbind` higher-order operator: under a `TorchDispatchMode` of that thread it raises"
        " `NotImplementedError: There was no rule registered for HigherOrderOperator call_torchbind` (torch 2.10,"
        " 2.13, 2.15; by the code `AssertionError` on 2.3 – 2.4); two `MetaTracer` traces that overlap leave the "
        "first one's wrappers as `torch.zeros` and the rest for good (2.2, 2.10, 2.13, 2.15). The patches now act"
        " in the thread that makes them (`trace-patch-isolation`'s per-thread dispatcher)"
    ),
    releases_note="the torchbind part from 2.3",
    caveats=(
        "It leaves as it was the `torch.ScriptObject` that `enable_torchbind_tracing()` appends to AOTAutograd's "
        "`KNOWN_TYPES` (every thread appends the same type, so its check on leaving holds, and the list only "
        "widens which inputs AOTAutograd accepts). While any thread holds such a patch, the module slot holds the"
        " dispatcher, a Python function. It imports `torch.fx.experimental.meta_tracer` when it applies (about 1 "
        "ms). A backward that autograd runs on its device thread (CUDA) sees the patching thread's patches from "
        "torch 2.13 (torch's thread-local stash), before that torch's originals (a torchbind call in a traced "
        "backward, say)."
    ),
    survey_rows=(
        "torch/_higher_order_ops/torchbind.py: torch.ScriptMethod.__call__ / KNOWN_TYPES",
        "torch/fx/experimental/meta_tracer.py: torch.<constructor fns>",
    ),
)
