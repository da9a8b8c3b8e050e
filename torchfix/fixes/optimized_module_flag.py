"""optimized-module-flag: whether a compiled module's call is under way belongs to the thread that calls it.

Every call of a module compiled with ``torch.compile`` (``OptimizedModule.__call__``) sets the module global
``torch._dynamo.eval_frame._in_optimized_module`` to True while it runs (``_set_in_optimized_module``) and puts
the old value back at its end. ``_is_in_optimized_module()`` reads it: ``torch.distributed._tools.ModTracker``
(which FSDP2's memory tracker and the activation-checkpointing estimators use) skips its module hooks while it is
True, since a compiled module's submodules run inside the graph. As a process global, one thread's compiled
module call makes every other thread's ModTracker hooks skip their (eager) modules, and two calls that
overlap can leave it True after both have ended (A sets it, B saves True, A restores False, B restores True).
A global from 2.10 to 2.15.

The flag moves to per-thread storage (``eval_frame._in_optimized_module_tls``) with :class:`ThreadLocalGlobals`;
both functions that use it are in ``eval_frame``. Every compiled module's call writes it twice, so it is a plain
``threading.local`` (``seen_in_backward=False``): its accesses call nothing, where the holders that autograd's
device thread shares with the forward's thread cost a compiled ``nn.Linear`` call 16 more Python calls (torch
2.13). A backward is never inside a compiled module's call, and on the device thread the flag reads False, the
value torch's global has there too whenever no other thread is in such a call.

Those three accesses are what torchfix adds to a compiled module's call, counted in machine instructions by
``python -m bench instructions`` (its figures: BENCHMARKS.md).
"""

from __future__ import annotations

import threading

from .._fix import Scenario, releases
from ..doctor.scenarios import Result, module_around
from ..patching.patches import moved_globals_fix

MODULE = "torch._dynamo.eval_frame"
NAME = "_in_optimized_module"


def optimized_module_elsewhere(timeout: float = 60.0) -> Result | None:
    """Thread A calls a compiled module whose graph waits while it runs; meanwhile the main thread, which runs
    no compiled module, asks ``_is_in_optimized_module()``: it must answer False (and A, inside, True). None
    where torch has no such flag (before 2.10)."""
    import torch
    from torch._dynamo import eval_frame

    if not hasattr(eval_frame, "_is_in_optimized_module"):
        return None
    running, release, seen = threading.Event(), threading.Event(), {}
    waits_in: list[int] = []  # the thread whose call waits inside the graph

    def backend(gm, example_inputs):
        def run(*args):
            if threading.get_ident() in waits_in and not running.is_set():
                seen["inside A's compiled module"] = eval_frame._is_in_optimized_module()
                running.set()
                release.wait(timeout)
            return gm(*args)

        return run

    compiled = torch.compile(module_around(lambda x: x + 1), backend=backend)
    # Compiled here, so that A only calls: torch 2.10 - 2.11 can crash compiling in a thread after another did.
    compiled(torch.ones(2))

    def call_in_a() -> None:
        waits_in.append(threading.get_ident())
        try:
            compiled(torch.ones(2))
        except Exception as exc:
            seen["A's call"] = f"raised {type(exc).__name__}: {exc}"
        finally:
            running.set()

    thread = threading.Thread(target=call_in_a, name="torchfix-selftest", daemon=True)
    thread.start()
    running.wait(timeout)
    seen["the main thread"] = eval_frame._is_in_optimized_module()
    release.set()
    thread.join(timeout)
    detail = "; ".join(f"{where}: {value}" for where, value in seen.items())
    hazard = seen.get("the main thread") is not False or seen.get("inside A's compiled module") is not True
    return Result("optimized module (a compiled module's call in one thread, the flag read in another)", hazard, detail)


FIX = moved_globals_fix(
    "optimized-module-flag",
    "while one thread calls a module compiled with torch.compile, _is_in_optimized_module() is True in every "
    "thread, so other threads' ModTracker (FSDP2 memory tracking) skips their modules' hooks",
    "2.10",
    MODULE,
    "_in_optimized_module_tls",
    {NAME: "in_optimized_module"},
    order=350,
    seen_in_backward=False,
    trigger=MODULE,
    scenarios=(
        Scenario(
            optimized_module_elsewhere,
            releases("2.10"),
            needs=f"{MODULE}.{NAME} (2.10+)",
            shows="the main thread: True",
        ),
    ),
    shared_state=(
        "`torch._dynamo.eval_frame._in_optimized_module`, True while a module compiled with `torch.compile` is "
        "being called (`OptimizedModule.__call__`), is a process global that `_is_in_optimized_module()` reads "
        "(`torch.distributed._tools.ModTracker`, FSDP2's memory tracker)"
    ),
    symptom=(
        "while one thread calls a compiled module, other threads' ModTracker skips their modules' hooks, and two "
        "calls that overlap can leave it True after both ended; now per thread, in a plain `threading.local` (with "
        "every fix, a compiled module's call runs no more Python calls and 8 more bytecode instructions, on Python "
        "3.11 and 3.12 alike, counted on 2.13)"
    ),
    releases_note='before 2.10: "not needed"',
    survey_rows=("torch/_dynamo/eval_frame.py: _in_optimized_module",),
)
