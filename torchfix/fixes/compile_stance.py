"""compile-stance: ``torch.compiler.set_stance`` acts in the thread that sets it.

``torch.compiler.set_stance`` (torch 2.6+) keeps the stance in one module global,
``torch._dynamo.eval_frame._stance``, which every compiled call reads (``_callback_from_stance``) to decide
whether to run compiled, eagerly, or fail on a recompile. So one thread's
``with torch.compiler.set_stance("force_eager"):`` (an evaluation pass, a debugging region) makes every
other thread's compiled calls run eagerly while it lasts: silent, and as slow as an eager fallback (measured
on torch 2.13 and 2.14.1 with the rest of torchfix on: 0 of 5 calls in another thread compiled). Still a
global in 2.15.

The stance moves to per-thread storage (``eval_frame._stance_tls``): each thread starts with the default
stance (``DynamoStance()``, evaluated per thread), ``set_stance`` and its context manager set and restore the
calling thread's, and ``eval_frame._stance`` read from other modules (compiled autograd, 2.6+) goes through
the module ``__getattr__`` of :class:`ThreadLocalGlobals` to the calling thread's. Not covered: the
``skip_guard_eval_unsafe`` stance also sets a flag in eval_frame's C code, which is process-wide in every
release (upstream pytorch/pytorch#196637); and compiled autograd running on autograd's device thread reads
that thread's stance (the default), not the stance of the thread whose backward it runs.
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Callable

from .._fix import Fix, Scenario, SoakAction, SoakCheck, releases
from ..doctor.scenarios import Result, counting_compile, fresh_add_one
from ..patching.patches import ThreadLocalGlobals, moved_global_probe

MODULE = "torch._dynamo.eval_frame"
HOLDER = "_stance_tls"


def stance_elsewhere(timeout: float = 60.0) -> Result | None:
    """While thread A is inside ``with torch.compiler.set_stance("force_eager")``, the main thread calls a
    function compiled with a backend that counts its compiles: it must compile. None before torch 2.6."""
    import torch

    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)  # no torch.compiler before 2.1
    if set_stance is None:
        return None
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(len(example_inputs))
        return gm.forward

    def triple(x):
        return x * 3

    inside, release = threading.Event(), threading.Event()

    def evaluate() -> None:
        with set_stance("force_eager"):
            inside.set()
            release.wait(timeout)

    thread = threading.Thread(target=evaluate, name="torchfix-selftest")
    thread.start()
    inside.wait(timeout)
    try:
        torch.compile(triple, backend=counting)(torch.ones(2))
    finally:
        release.set()
        thread.join(timeout)
    detail = f"the backend compiled {len(compiles)} graph(s) for the call"
    return Result("stance (set_stance('force_eager') in one thread, a compiled call in another)", not compiles, detail)


def soak_stance() -> Callable[[random.Random], None] | None:
    """The soak's ``stance force_eager``: a compiled call inside this thread's ``set_stance("force_eager")`` must
    run eagerly (another thread restoring the stance makes it run compiled). None before torch 2.6."""
    import torch

    if not hasattr(getattr(torch, "compiler", None), "set_stance"):
        return None
    compiled, graph_runs = counting_compile(fresh_add_one(), "aot_eager")

    def call(rng: random.Random) -> None:
        before = graph_runs()
        with torch.compiler.set_stance("force_eager"):
            x = torch.ones(2)
            assert torch.equal(compiled(x), x + 1), "compiled call under force_eager: wrong result"
        assert graph_runs() == before, "a compiled call under this thread's force_eager ran compiled"

    return call


def soak_leak_probe() -> Callable[[bool], bool]:
    """Whether the calling thread's stance is not the default."""
    return lambda at_end: getattr(getattr(sys.modules.get(MODULE), "_stance", None), "stance", "default") != "default"


FIX = Fix(
    name="compile-stance",
    order=60,
    hazard="one thread's torch.compiler.set_stance('force_eager') makes every thread's compiled calls run eagerly",
    versions=releases("2.6"),
    probe=moved_global_probe(MODULE, HOLDER, "_stance", "this torch has no torch.compiler.set_stance (2.6+)"),
    patches=lambda _torch_version: [
        ThreadLocalGlobals(MODULE, "torch/_dynamo/eval_frame.py", HOLDER, {"_stance": "stance"}, seen_in_backward=True)
    ],
    trigger=MODULE,
    scenarios=(Scenario(stance_elsewhere, releases("2.6"), needs="torch.compiler.set_stance (2.6+)"),),
    shared_state=(
        "`torch.compiler.set_stance` keeps the stance in one global, `torch._dynamo.eval_frame._stance`, read by "
        "every compiled call"
    ),
    symptom=(
        'while one thread is inside `with torch.compiler.set_stance("force_eager")` (an evaluation pass), every '
        "thread's compiled calls run eagerly, silently"
    ),
    releases_note='no `set_stance` before 2.6: "not needed"',
    soak=SoakCheck(
        errors=("force_eager ran compiled",),
        actions=(SoakAction("stance force_eager", 1, soak_stance),),
        leak_probe=soak_leak_probe,
    ),
    survey_rows=("torch/_dynamo/eval_frame.py: _stance",),
)
