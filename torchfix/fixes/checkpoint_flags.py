"""checkpoint-flags: ``set_checkpoint_early_stop`` and ``set_checkpoint_debug_enabled`` act in their own thread.

``torch.utils.checkpoint`` keeps the two overrides in module globals, ``_enable_checkpoint_early_stop`` (torch 2.1+)
and ``_checkpoint_debug_enabled`` (2.2+), which ``set_checkpoint_early_stop(...)`` and
``set_checkpoint_debug_enabled(...)`` save, set and restore. Every non-reentrant checkpoint reads them: while one
thread is inside one of them, every other thread's checkpoints take its setting (``early_stop=False`` recomputes
whole functions, ``debug=True`` records every op and refuses a ``context_fn``), and two threads that interleave
leave one's value set for good.

Both move to per-thread storage (``checkpoint._checkpoint_flags_tls``) with :class:`ThreadLocalGlobals`. Where they
are read matters, since a checkpoint's recompute runs in backward, which can run on autograd's device thread: in
every release both are read only in the forward (``_checkpoint_without_reentrant_generator``), in the thread that
calls ``checkpoint``, and stored in the checkpoint's frame, which the recompute uses. So a value set in the forward's
thread is the one its backward sees, on any thread. No other module of torch reads or writes them.
"""

from __future__ import annotations

import contextlib

from .._fix import Scenario, releases
from ..doctor.scenarios import Result, held_elsewhere
from ..patching.patches import moved_globals_fix

MODULE = "torch.utils.checkpoint"


def checkpoint_flags_elsewhere(timeout: float = 60.0) -> Result | None:
    """Thread A waits inside ``set_checkpoint_early_stop(False)`` and ``set_checkpoint_debug_enabled(True)``
    (2.2+); meanwhile the main thread runs a non-reentrant checkpoint and its backward, then one with a
    ``context_fn``. Its recompute must stop early (the function's tail runs once, in the forward) and the second
    checkpoint must run (with debug on it raises ``ValueError``); A must see its own setting."""
    import torch
    import torch.utils.checkpoint as checkpoint

    if not hasattr(checkpoint, "set_checkpoint_early_stop"):  # 2.1+
        return None

    seen: dict[str, object] = {}
    tail_runs = []

    def function(x):
        y = x.sin()  # sin saves x: the recompute has all it needs here, and an early stop ends it
        tail_runs.append(1)
        return y + 1

    def own_view() -> None:
        seen["A's own early stop"] = checkpoint._enable_checkpoint_early_stop

    settings = [lambda: checkpoint.set_checkpoint_early_stop(False)]
    if hasattr(checkpoint, "set_checkpoint_debug_enabled"):  # 2.2+
        settings.append(lambda: checkpoint.set_checkpoint_debug_enabled(True))
    with held_elsewhere(settings, own_view, timeout) as held:
        if not held:
            return Result("checkpoint flags", True, "the other thread never entered set_checkpoint_early_stop")
        x = torch.ones(2, requires_grad=True)
        checkpoint.checkpoint(function, x, use_reentrant=False).sum().backward()
        seen["runs of the function's tail"] = len(tail_runs)
        try:
            checkpoint.checkpoint(function, x, use_reentrant=False, context_fn=_contexts)
            seen["a checkpoint with a context_fn"] = "ran"
        except ValueError as exc:
            seen["a checkpoint with a context_fn"] = f"raised ValueError: {exc}"
    hazard = (
        seen["runs of the function's tail"] != 1
        or seen["a checkpoint with a context_fn"] != "ran"
        or seen.get("A's own early stop") is not False
    )
    detail = "; ".join(f"{what}: {value}" for what, value in seen.items())
    return Result(
        "checkpoint flags (set_checkpoint_early_stop / set_checkpoint_debug_enabled in another thread)", hazard, detail
    )


def _contexts():
    return contextlib.nullcontext(), contextlib.nullcontext()


FIX = moved_globals_fix(
    "checkpoint-flags",
    "while one thread is inside set_checkpoint_early_stop(False) or set_checkpoint_debug_enabled(True), every "
    "thread's checkpoints recompute whole functions or run in debug mode (which refuses a context_fn)",
    "2.1",
    MODULE,
    "_checkpoint_flags_tls",
    {"_enable_checkpoint_early_stop": "early_stop", "_checkpoint_debug_enabled": "debug"},
    order=340,
    optional=frozenset({"_checkpoint_debug_enabled"}),
    trigger=MODULE,
    scenarios=(Scenario(checkpoint_flags_elsewhere, releases("2.1"), shows="runs of the function's tail: 2"),),
    shared_state=(
        "`torch.utils.checkpoint.set_checkpoint_early_stop()` and `set_checkpoint_debug_enabled()` keep their "
        "setting in process globals, `_enable_checkpoint_early_stop` and `_checkpoint_debug_enabled` (2.2+), "
        "which every non-reentrant checkpoint reads"
    ),
    symptom=(
        "while one thread is inside `set_checkpoint_early_stop(False)`, every thread's checkpoints recompute "
        "their whole function in backward (more time, same results); inside `set_checkpoint_debug_enabled(True)`,"
        " every thread's checkpoints run in debug mode, and one with a `context_fn` raises `ValueError: "
        "debug=True is incompatible with non-default context_fn` (torch 2.10, 2.13, 2.15)"
    ),
    releases_note='before 2.1: "not needed"',
    caveats=(
        "`checkpoint-flags` changes what a setting reaches: `set_checkpoint_early_stop(False)` or "
        "`set_checkpoint_debug_enabled(True)` entered in one thread no longer applies to checkpoints that other "
        "threads run meanwhile; enter it in each thread that needs it."
    ),
    seen_in_backward=True,
    survey_rows=(
        "torch/utils/checkpoint.py: _checkpoint_debug_enabled",
        "torch/utils/checkpoint.py: _enable_checkpoint_early_stop",
    ),
)
