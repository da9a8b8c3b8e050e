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
skips: ``torch.compile`` of it runs it eagerly, for good, without a word (reproduced on torch 2.2, 2.13 and 2.15:
the backend got no graph); it is a ``_LazyGraphModule``, which ``torch.jit.script`` refuses (2.13, 2.15). Two
traces that overlap (2.9+: ``aot_compile`` or strict export beside a compile) restore the attribute out of order
and can leave the skipping function in place for the process: every GraphModule built after that runs eagerly
under ``torch.compile`` (reproduced on 2.13 and 2.15 with an ``aot_compile``).

The attribute's writes become per-thread patches (``convert_frame._thread_patches``, a ``ThreadPatches`` of
``patching/slots.py``): while a thread compiles, ``_forward_from_src`` holds a dispatcher that gives that
thread the skipping function and every other thread torch's own. The two flags move to per-thread storage
(``_lazy_graph_module._lazy_graph_module_tls``) with :class:`ThreadLocalGlobals`. Compiled calls read neither.
Not covered (2.0 - 2.1, where ``torch.compile`` itself calls ``wrap_convert_context``): a ``torch.compile`` made
before the fix applied (or after ``uninstall()``) keeps torch's code, which patches the attribute for the process.
"""

from __future__ import annotations

import importlib
import threading

from .._fix import Fix, Scenario, minor_release, releases
from ..doctor.scenarios import HeldTrace, Result, fresh
from ..patching.patches import SourcePatch, ThreadLocalGlobals
from ..patching.slots import HELPER, SlotPatches

CONVERT_FRAME, LAZY = "torch._dynamo.convert_frame", "torch.fx._lazy_graph_module"
FLAGS = {"_use_lazy_graph_module_flag": "use_lazy", "_force_skip_lazy_graph_module_flag": "force_skip"}


def _patches(torch_version: str) -> list[SourcePatch]:
    # The function that patches it: wrap_convert_context in 2.0 - 2.1, preserve_global_state from 2.2.
    patcher = "wrap_convert_context" if minor_release(torch_version) < (2, 2) else "preserve_global_state"
    patches: list[SourcePatch] = [SlotPatches(CONVERT_FRAME, patcher, "torch.fx.graph_module", "_forward_from_src", 1)]
    if minor_release(torch_version) >= (2, 3):  # lazy graph modules from 2.3
        patches.append(
            ThreadLocalGlobals(
                LAZY, "torch/fx/_lazy_graph_module.py", "_lazy_graph_module_tls", FLAGS, seen_in_backward=True
            )
        )
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


def _graphs_compiled(graph_module: object) -> int:
    """How many graphs ``torch.compile`` of ``graph_module`` gives its backend (none: its forward runs eagerly)."""
    import torch

    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(graph_module, backend=counting_backend)(torch.ones(2))
    return len(graphs)


def _compiled(graphs: int) -> str:
    return f"gave its backend {graphs} graph(s)" if graphs else "gave its backend no graph (ran eagerly)"


def graph_module_built_elsewhere(timeout: float = 60.0) -> Result:
    """While thread A is inside a ``torch.compile`` (its backend waits), the main thread ``symbolic_trace``s a
    function and calls the GraphModule once (which makes its forward, at once or, for a lazy one, at that call).
    It must be a plain GraphModule, and, compiled afterwards with ``torch.compile``, reach the backend as a graph
    rather than run eagerly."""
    import torch

    with HeldTrace("compile", timeout):
        built = torch.fx.symbolic_trace(fresh(_times_two))
        built(torch.ones(2))
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # no lazy graph modules before 2.3
        _LazyGraphModule = ()
    lazy = isinstance(built, _LazyGraphModule)
    graphs = _graphs_compiled(built)
    return Result(
        "GraphModule build (a GraphModule built in one thread while another compiles)",
        lazy or not graphs,
        f"the main thread's symbolic_trace made {'a _LazyGraphModule' if lazy else 'a GraphModule'}; "
        f"torch.compile of it {_compiled(graphs)}",
    )


_waits: dict[int, tuple[threading.Event, threading.Event, float]] = {}  # thread id -> (inside, release, timeout)
_wait_op = None  # torchfix_selftest::wait_in_trace, registered at first use (once per process)


def _register_wait_op() -> None:
    """``torchfix_selftest::wait_in_trace``, ``x.clone()``: its fake implementation, which Dynamo runs while it
    traces a call of it, waits in each thread listed in ``_waits`` (once) until released."""
    global _wait_op
    if _wait_op is not None:
        return
    import torch

    @torch.library.custom_op("torchfix_selftest::wait_in_trace", mutates_args=(), schema="(Tensor x) -> Tensor")
    def wait_in_trace(x):
        return x.clone()

    @wait_in_trace.register_fake
    def _(x):
        inside, release, timeout = _waits.pop(threading.get_ident(), (None, None, 0.0))
        if inside is not None:
            inside.set()
            release.wait(timeout)
        return torch.empty_like(x)

    _wait_op = wait_in_trace


def _through_wait_op(x):
    return _wait_op(x) + 1  # the operator as a global: aot_compile cannot save a closure that holds it


def forward_from_src_restored_out_of_order(timeout: float = 60.0) -> Result | None:
    """Thread A is inside a ``torch.compile`` (its backend waits); thread B then traces an ``aot_compile`` (which
    takes no compile_lock) and waits inside its trace; A finishes, then B. Afterwards
    ``torch.fx.graph_module._forward_from_src`` must be torch's own again, and a GraphModule the main thread builds
    must compile. None where ``torch.compile`` has no ``aot_compile`` on by default (before 2.12)."""
    import torch
    import torch.fx.graph_module as graph_module

    if not hasattr(torch.compile(_through_wait_op), "aot_compile"):
        return None
    _register_wait_op()
    original = graph_module._forward_from_src
    inside, release, errors = threading.Event(), threading.Event(), []

    def aot_compile() -> None:
        _waits[threading.get_ident()] = (inside, release, timeout)
        try:
            torch.compile(fresh(_through_wait_op), fullgraph=True, backend="eager").aot_compile(((torch.ones(2),), {}))
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            inside.set()

    b = threading.Thread(target=aot_compile, name="torchfix-selftest", daemon=True)
    try:
        with HeldTrace("compile", timeout):
            b.start()
            inside.wait(timeout)
    finally:  # B goes on after A, also where A failed
        release.set()
        if b.is_alive():
            b.join(timeout)
    reached = b.ident not in _waits  # B's trace reached the operator's fake implementation
    _waits.pop(b.ident, None)
    left = graph_module._forward_from_src is not original
    graphs = _graphs_compiled(torch.fx.symbolic_trace(fresh(_times_two)))
    graph_module._forward_from_src = original  # where the skipping one was left: for the scenarios after this one
    detail = f"afterwards torch.compile of a GraphModule the main thread built {_compiled(graphs)}"
    detail += "; left patched: torch.fx.graph_module._forward_from_src" if left else ""
    detail += "" if reached else "; the aot_compile never reached its trace"
    detail += f"; the aot_compile raised {errors[0]}" if errors else ""
    return Result(
        "GraphModule build (a compile and an aot_compile in two threads, finishing in the order they started)",
        left or not graphs or not reached,
        detail,
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
            shows="gave its backend no graph",
            # Torch alone segfaults there in FakeTensorMode.__enter__ when the main thread compiles after another
            # thread did (2 of 3 runs on 2.10), as for make-fx-tracer's.
            crashes=releases("2.10", "2.11"),
        ),
        Scenario(
            forward_from_src_restored_out_of_order,
            releases("2.12"),
            needs="torch.compile(...).aot_compile, on by default (torch 2.12+)",
            shows="left patched: torch.fx.graph_module._forward_from_src",
            stage=1,  # without the fix, it can leave every later GraphModule's forward skipped, if it fails midway
        ),
    ),
    shared_state=(
        "every Dynamo compile (and, from 2.9, every unlocked `aot_compile` and strict `torch.export` trace) "
        "replaces `torch.fx.graph_module._forward_from_src` for the process while it runs "
        "(`convert_frame.preserve_global_state`) with a version that marks each new forward for Dynamo to skip, "
        "and sets `torch.fx._lazy_graph_module._use_lazy_graph_module_flag`, a process global (2.3+)"
    ),
    symptom=(
        "a GraphModule another thread builds or first calls meanwhile (`symbolic_trace`, `make_fx`) gets a "
        "forward that `torch.compile` then runs eagerly, for good and silently, and is a `_LazyGraphModule` "
        "(which `torch.jit.script` refuses) (torch 2.13, 2.15; 2.2 without the lazy part); a compile and an "
        "`aot_compile` that overlap leave the skipping function in place, so every GraphModule built after that "
        "runs eagerly under `torch.compile` (torch 2.13, 2.15). The patch now acts in the compiling thread only "
        "(`trace-patch-isolation`'s per-thread dispatcher) and the flags are per thread"
    ),
    releases_note="the flag from 2.3",
    caveats=(
        "While any thread compiles, `torch.fx.graph_module._forward_from_src` holds the dispatcher (torch's "
        "function for every thread but the compiling one). On torch 2.0 – 2.1 a `torch.compile` made before the "
        "fix applied (or after `uninstall()`) keeps torch's code, which still patches that name for the whole "
        "process."
    ),
    survey_rows=(
        "torch/_dynamo/convert_frame.py: torch.fx.graph_module._forward_from_src",
        "torch/fx/_lazy_graph_module.py: _force_skip_lazy_graph_module_flag",
        "torch/fx/_lazy_graph_module.py: _use_lazy_graph_module_flag",
    ),
)
