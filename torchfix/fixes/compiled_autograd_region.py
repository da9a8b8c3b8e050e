"""compiled-autograd-region: ``torch._dynamo.compiled_autograd.in_compiled_autograd_region`` is per thread.

While a compiled-autograd graph runs, ``runtime_wrapper`` (made by ``AutogradCompilerInstance.end_capture``) sets
the module global ``in_compiled_autograd_region`` to True, in the thread that called ``backward()`` (compiled
autograd runs there, not on autograd's device threads). Dynamo and AOTAutograd read it when they compile, by
module attribute, in the compiling thread: ``_dynamo.utils``, ``output_graph`` (2.8+), ``variables/misc.py``
(2.6+), AOTAutograd's ``collect_metadata_analysis``, ``jit_compile_runtime_wrappers`` (2.5 - 2.8; ``graph_compile``
from 2.9), ``runtime_wrappers`` (2.8+) and ``autograd_cache`` (2.5 - 2.6): to compile a graph as compiled
autograd's (every parameter static, no guard on saved-tensor hooks and the hooks left out, inputs flattened its
way, no AOTAutograd cache). FSDP2's ``detect_compiled_autograd`` (2.6 - 2.11) reads it in eager code, and 2.7 -
2.8's AOTAutograd backward (``process_runtime_tangent``, on whichever thread runs it) to relax a type check. As a
process global, a compile in any other thread while one thread runs a compiled-autograd graph reads True and
compiles its graph that way too (reproduced on torch 2.13). A global from 2.5 (which added it) to 2.15.

The global moves to per-thread storage (``compiled_autograd._in_compiled_autograd_region_tls``) with
:class:`ThreadLocalGlobals`: ``runtime_wrapper`` and ``reset`` are the only code that uses it as a global, and
every other reader reaches it by module attribute (the module ``__getattr__``). A thread starts with torch's
default (False). ``runtime_wrapper`` is a closure that compiled autograd keeps in its C++ cache with each compiled
graph, so the code it was made with outlives the patch (or predates it): torchfix empties that cache when it applies
and reverts the fix, while no thread is in a compiled-autograd graph, and the graphs are compiled again at their next
backward. What changes beyond the flag: ``compiled_autograd.reset()`` (``torch._dynamo.reset()``) refuses to run only
inside the calling thread's own compiled-autograd graph, no longer while another thread runs one.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import threading
import types

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result, fresh
from ..patching.patches import ThreadLocalGlobals, moved_global_probe

MODULE = "torch._dynamo.compiled_autograd"
HOLDER = "_in_compiled_autograd_region_tls"
NAME = "in_compiled_autograd_region"


def _clear_compiled_graphs() -> None:
    """Drop compiled autograd's cached graphs and the ``runtime_wrapper`` closures kept with them, as ``reset()``
    does: cached closures run the code they were made with."""
    import torch

    clear = getattr(getattr(torch._C._dynamo, "compiled_autograd", None), "clear_cache", None)
    if clear is not None:
        clear()


class _RegionPerThread(ThreadLocalGlobals):
    def __init__(self) -> None:
        super().__init__(MODULE, MODULE.replace(".", "/") + ".py", HOLDER, {NAME: "in_region"}, seen_in_backward=True)

    def describe(self) -> str:
        return (
            super().describe() + "; compiled autograd's cache of compiled graphs is emptied when applied and reverted"
        )

    def _install_state(self, module: types.ModuleType, source: str) -> None:
        in_region = vars(module).get(NAME, False)
        super()._install_state(module, source)
        if not in_region:
            _clear_compiled_graphs()

    def _remove_state(self, module: types.ModuleType) -> None:
        in_region = vars(module)[HOLDER].overridden  # threads inside a compiled-autograd graph
        super()._remove_state(module)
        if not in_region:
            _clear_compiled_graphs()


_RUNS = itertools.count(1)  # compiled autograd caches a graph per autograd graph: each run's is new


def compiled_autograd_region_elsewhere(timeout: float = 60.0) -> Result | None:
    """Thread A runs a backward under compiled autograd, whose compiled graph waits while it runs; meanwhile the
    main thread compiles a function with a backend that reads ``in_compiled_autograd_region``: it must read False
    (it compiles no compiled-autograd graph), and A inside its graph True. None where torch has no such flag
    (before 2.5)."""
    import torch

    if importlib.util.find_spec(MODULE) is None:  # no compiled autograd (torch 2.0)
        return None
    ca = importlib.import_module(MODULE)
    enable = getattr(ca, "_enable", None) or getattr(ca, "enable", None)  # enable: 2.5
    if enable is None or not hasattr(ca, NAME):
        return None
    running, release, seen = threading.Event(), threading.Event(), {}
    a_thread: list[int] = []

    def compiler(graph):
        def run(*args):
            if threading.get_ident() in a_thread and not running.is_set():
                seen["inside the graph"] = getattr(ca, NAME)
                running.set()
                release.wait(timeout)
            return graph(*args)

        return run

    def backward_in_a() -> None:
        a_thread.append(threading.get_ident())
        try:
            w = torch.ones(2, requires_grad=True)
            x = w
            for _ in range(next(_RUNS)):
                x = x * 2
            with enable(compiler):
                x.sum().backward()
        except Exception as exc:
            seen["the backward"] = f"raised {type(exc).__name__}: {exc}"
        finally:
            running.set()

    def backend(gm, example_inputs):
        seen["the main thread's compile"] = getattr(ca, NAME)
        return gm.forward

    thread = threading.Thread(target=backward_in_a, name="torchfix-selftest", daemon=True)
    thread.start()
    running.wait(timeout)
    try:
        torch.compile(fresh(_times_three), backend=backend)(torch.ones(2))
    finally:
        release.set()
        thread.join(timeout)
    detail = "; ".join(f"{where}: {NAME} {value}" for where, value in seen.items())
    hazard = seen.get("the main thread's compile") is not False or seen.get("inside the graph") is not True
    return Result(
        "compiled autograd region (a compiled-autograd graph running in one thread, a compile in another)",
        hazard,
        detail,
    )


def _times_three(x):
    return x * 3 + 1


FIX = Fix(
    name="compiled-autograd-region",
    order=210,
    hazard="while one thread runs a compiled-autograd graph, other threads' compiles read "
    "in_compiled_autograd_region True and compile their graphs as compiled autograd's",
    versions=releases("2.5"),
    probe=moved_global_probe(MODULE, HOLDER, NAME, f"{MODULE} has no {NAME} (before torch 2.5)"),
    patches=lambda _torch_version: [_RegionPerThread()],
    trigger=MODULE,
    scenarios=(
        Scenario(
            compiled_autograd_region_elsewhere,
            releases("2.5"),
            needs=f"{MODULE}.{NAME} (2.5+)",
            shows=f"the main thread's compile: {NAME} True",
            # A second run in one process segfaults in compiled autograd's capture, in FakeTensorMode.__enter__ as
            # make-fx-tracer's does, fix or not (2.10, 2.11; 2.13 - 2.15 run it three times).
            crashes=releases("2.10", "2.11"),
        ),
    ),
    shared_state=(
        "`torch._dynamo.compiled_autograd.in_compiled_autograd_region`, True while a compiled-autograd graph runs"
        " in the thread that called `backward()`, is a process global that every thread's Dynamo and AOTAutograd "
        "compile reads"
    ),
    symptom=(
        "while one thread runs a compiled-autograd graph, other threads compile their graphs as compiled "
        "autograd's (every parameter static, no guard on saved-tensor hooks, saved-tensor hooks left out)"
    ),
    releases_note='before 2.5: "not needed"',
    caveats=(
        "It empties compiled autograd's cache of compiled graphs when it is applied and when it is removed (each "
        "cached graph keeps a closure made by the file it patches), so graphs compiled before are compiled again "
        "at their next backward."
    ),
    survey_rows=("torch/_dynamo/compiled_autograd.py: in_compiled_autograd_region",),
)
