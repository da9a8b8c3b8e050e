"""graph-module-build: how a GraphModule is built is the business of the thread that builds it.

A Dynamo compile changes, for its whole duration, how every ``torch.fx.GraphModule`` of the process is built:

* ``convert_frame.preserve_global_state`` (``wrap_convert_context`` in 2.0 - 2.1), around every frame compile of
  ``torch.compile`` and, from 2.9, the unlocked traces of ``aot_compile`` and strict ``torch.export``, writes
  ``fx_forward_from_src_skip_result`` over ``torch.fx.graph_module._forward_from_src`` and restores what it read in
  ``finally``. ``GraphModule.recompile`` makes each forward with that function, and the skipping one marks the
  forward's code for Dynamo to skip, for good (so that Dynamo does not compile its own graphs again);
* ``torch.fx._lazy_graph_module``'s ``_use_lazy_graph_module_flag`` (2.3+), set by ``_use_lazy_graph_module()``,
  which every Dynamo compile and Inductor's ``compile_fx`` enter (and ``_force_skip_lazy_graph_module_flag``, its
  veto), module globals: every GraphModule built meanwhile (``symbolic_trace``, ``make_fx``, ``split_module``) is a
  ``_LazyGraphModule``, whose forward is made at its first call.

So a GraphModule that another thread builds, or first calls, while one thread compiles gets a forward that Dynamo
skips: ``torch.compile`` of it runs it eagerly, for good, without a word (reproduced on torch 2.13 and 2.15: the
backend got no graph); it is a ``_LazyGraphModule``, which ``torch.jit.script`` refuses. Two traces that overlap
(2.9+: ``aot_compile`` or strict export beside a compile) restore the attribute out of order and can leave the
skipping function in place for the process.

The attribute's writes become per-thread patches (``convert_frame._thread_patches``, a ``ThreadPatches`` of
``fixes/_thread_patches.py``): while a thread compiles, ``_forward_from_src`` holds a dispatcher that gives that
thread the skipping function and every other thread torch's own. The two flags move to per-thread storage
(``_lazy_graph_module._lazy_graph_module_tls``) with :class:`ThreadLocalGlobals`. Compiled calls read neither.
Not covered (2.0 - 2.1): a ``torch.compile`` wrapper made while the fix was uninstalled keeps torch's code, which
patches the attribute for the process.
"""

from __future__ import annotations

import importlib

from .._fix import Fix, Scenario, minor_release, releases
from .._patch import SourcePatch, ThreadLocalGlobals
from .._selftest import HeldTrace, Result, fresh
from ._thread_patches import HELPER, PatchWritesPerThread

CONVERT_FRAME, LAZY = "torch._dynamo.convert_frame", "torch.fx._lazy_graph_module"
FORWARD_FROM_SRC = "torch.fx.graph_module._forward_from_src"
FLAGS = {"_use_lazy_graph_module_flag": "use_lazy", "_force_skip_lazy_graph_module_flag": "force_skip"}


def _patches(torch_version: str) -> list[SourcePatch]:
    patches: list[SourcePatch] = [
        PatchWritesPerThread(
            CONVERT_FRAME,
            "torch/_dynamo/convert_frame.py",
            {"wrap_convert_context": (FORWARD_FROM_SRC,), "preserve_global_state": (FORWARD_FROM_SRC,)},  # 2.0, 2.2+
        )
    ]
    if minor_release(torch_version) >= (2, 3):  # lazy graph modules from 2.3
        patches.append(ThreadLocalGlobals(LAZY, "torch/fx/_lazy_graph_module.py", "_lazy_graph_module_tls", FLAGS))
    return patches


def _probe() -> str | None:
    convert_frame = importlib.import_module(CONVERT_FRAME)
    if HELPER in vars(convert_frame):
        return "Dynamo's patch of torch.fx.graph_module._forward_from_src is per thread already"
    if not hasattr(convert_frame, "fx_forward_from_src_skip_result"):
        return "Dynamo does not patch torch.fx.graph_module._forward_from_src in this torch"
    return None


def _times_two(x):
    return x * 2


def graph_module_built_elsewhere(timeout: float = 60.0) -> Result:
    """While thread A is inside a ``torch.compile`` (its backend waits), the main thread ``symbolic_trace``s a
    function and calls the GraphModule once (which makes its forward, at once or, for a lazy one, at that call).
    It must be a plain GraphModule, and, compiled afterwards with ``torch.compile``, reach the backend as a graph
    rather than run eagerly."""
    import torch

    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with HeldTrace("compile", timeout):
        built = torch.fx.symbolic_trace(fresh(_times_two))
        built(torch.ones(2))
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # no lazy graph modules before 2.3
        _LazyGraphModule = ()
    lazy = isinstance(built, _LazyGraphModule)
    torch.compile(built, backend=counting_backend)(torch.ones(2))
    made = "a _LazyGraphModule" if lazy else "a GraphModule"
    ran = f"gave its backend {len(graphs)} graph(s)" if graphs else "gave its backend no graph (ran eagerly)"
    return Result(
        "GraphModule build (a GraphModule built in one thread while another compiles)",
        lazy or not graphs,
        f"the main thread's symbolic_trace made {made}; torch.compile of it {ran}",
    )


FIX = Fix(
    name="graph-module-build",
    order=360,
    hazard="a GraphModule built or first called while another thread compiles gets a forward Dynamo skips "
    "(torch.compile runs it eagerly, for good) and is a _LazyGraphModule",
    versions=releases("2.0"),
    probe=_probe,
    patches=_patches,
    trigger=CONVERT_FRAME,
    scenarios=(
        Scenario(
            graph_module_built_elsewhere,
            releases("2.0"),
            needs="torch.compile",
            shows="gave its backend no graph",
            # Torch alone segfaults there in FakeTensorMode.__enter__ when the main thread compiles after another
            # thread did (2 of 3 runs on 2.10), as for make-fx-tracer's.
            crashes=releases("2.10", "2.11"),
        ),
    ),
)
