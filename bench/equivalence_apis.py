"""The equivalence run's second corpus: each API a fix patches, used in one thread the way torch's docs show.

``main(OUT.json)`` runs every case in this interpreter and writes what each case observed: outputs, graph code, graph
breaks, recompiles and their reasons, the guards Dynamo wrote, and error messages. ``bench/equivalence.py`` runs it
twice, forked from one interpreter that imported this module: with torchfix imported (after torch, as a user may)
and without, and compares case by case. Both sides run each case under ``cProfile``; the side with torchfix also
reports which fixes' patched code each case called (``Patch.patched_code``), and a test checks that every fix applied
on the suite's torch runs in some case (but the fixes that declare ``needs_cuda``, on a machine without CUDA). On
Python 3.12 (cProfile on ``sys.monitoring``) the profile missed calls that 3.11's sees (export's serializer and
deserializer, torch 2.11, though it saw functions they call): there the report can undercount; the suite runs 3.11.
"""

from __future__ import annotations

import contextlib
import cProfile
import importlib
import io
import json
import logging
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._dynamo.utils import counters

from bench.equivalence import FIXES_RUN

warnings.simplefilter("ignore")

_ADDRESS = re.compile(r"\b(0x[0-9a-f]+|\d{7,})\b")  # object ids and addresses differ between interpreters


def _plain(text: str) -> str:
    return _ADDRESS.sub("<id>", text)


class _Seen:
    """What one case observed, as JSON-ready values."""

    def __init__(self) -> None:
        self.found: dict[str, object] = {}

    def __setitem__(self, key: str, value: object) -> None:
        self.found[key] = value

    def tensor(self, key: str, value: object) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach().to("cpu", torch.float64)
            self.found[key] = [list(value.shape), round(value.sum().item(), 6)]
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                self.tensor(f"{key}[{i}]", v)
        else:
            self.found[key] = repr(value)


@contextlib.contextmanager
def _compiles(seen: _Seen):
    """Dynamo's counts and its guard and recompile logs over the block, into ``seen``."""
    torch._dynamo.reset()
    counters.clear()
    logs = io.StringIO()
    handler = logging.StreamHandler(logs)
    loggers = [logging.getLogger(name) for name in ("torch._dynamo.guards", "torch._dynamo")]
    for logger in loggers:
        logger.addHandler(handler)
    torch._logging.set_logs(guards=True, recompiles=True)
    try:
        yield
    finally:
        torch._logging.set_logs()
        for logger in loggers:
            logger.removeHandler(handler)
        seen["graph_breaks"] = sum(counters["graph_break"].values())
        seen["recompiles"] = sum(counters["recompiles"].values())
        seen["frames"] = counters["stats"]["unique_graphs"]
        # Guard evaluation times differ from run to run.
        lines = [_plain(line) for line in logs.getvalue().splitlines() if line.strip() and "latency" not in line]
        seen["logs"] = lines


def _backend(codes: list[str]) -> Callable:
    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        codes.append(gm.code)
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)

    return backend


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.drop = torch.nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def _x() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(4, 8)


def compile_function(seen: _Seen) -> None:
    """torch.compile of a function with a graph break and a recompile on a new shape."""
    codes: list[str] = []

    def f(x):
        y = torch.sin(x) + torch.fx._symbolic_trace.is_fx_tracing()
        print("", end="")  # a graph break
        return y * (2 if torch.compiler.is_compiling() else 3)

    compiled = torch.compile(f, backend=_backend(codes))
    with _compiles(seen):
        seen.tensor("out", compiled(_x()))
        seen.tensor("again", compiled(_x()))
        seen.tensor("new_shape", compiled(torch.ones(3)))
    seen["graphs"] = codes


def compile_training_step(seen: _Seen) -> None:
    """A compiled module's training step (AOTAutograd joint graph, backward compiled with it) and an optimizer."""
    codes: list[str] = []
    model = _MLP()
    compiled = torch.compile(model, backend=_backend(codes))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with _compiles(seen):
        for step in range(2):
            loss = compiled(_x()).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            seen.tensor(f"loss{step}", loss)
    seen["graphs"] = codes
    seen.tensor("weight", model.fc1.weight)


def compile_inductor(seen: _Seen) -> None:
    """The default backend, forward and backward."""
    model = _MLP()
    compiled = torch.compile(model)
    with _compiles(seen):
        out = compiled(_x())
        out.sum().backward()
    seen.tensor("out", out)
    seen.tensor("grad", model.fc1.weight.grad)


def stance_and_disable(seen: _Seen) -> None:
    """set_stance, torch.compiler.disable (recursive and not), error_on_graph_break."""

    def inner(x):
        return x - 1 if torch.compiler.is_compiling() else x + 1

    def outer(g, x):
        return g(x)

    compiled = torch.compile(outer, backend="eager")
    with _compiles(seen):
        seen.tensor("non_recursive", compiled(torch.compiler.disable(inner, recursive=False), torch.ones(3)))
        seen.tensor("recursive", compiled(torch.compiler.disable(inner), torch.ones(3)))
        set_stance = getattr(torch.compiler, "set_stance", None)  # torch 2.6+
        if set_stance is not None:
            with set_stance("force_eager"):
                seen.tensor("force_eager", torch.compile(inner, backend="eager")(torch.ones(3)))
        error_on_graph_break = getattr(torch._dynamo, "error_on_graph_break", None)  # torch 2.9+
        if error_on_graph_break is not None:

            def breaks(x):
                print("", end="")
                return x + 1

            try:
                with error_on_graph_break(True):
                    torch.compile(breaks, backend="eager")(torch.ones(2))
            except Exception as exc:
                seen["error_on_graph_break"] = f"{type(exc).__name__}"


def symbolic_trace(seen: _Seen) -> None:
    """torch.fx.symbolic_trace with stack traces recorded, and a wrapped function."""

    class Tracer(torch.fx.Tracer):
        record_stack_traces = True

    graph = Tracer().trace(_MLP())
    seen["code"] = torch.fx.GraphModule(_MLP(), graph).code
    seen["stack_frames"] = sorted(
        {line.strip().split(",")[0] for node in graph.nodes for line in (node.stack_trace or "").splitlines()}
    )
    seen["tracing_after"] = torch.fx._symbolic_trace.is_fx_tracing()
    from torch.fx.experimental import meta_tracer

    meta = meta_tracer.symbolic_trace(_MLP(), meta_args={"x": torch.randn(4, 8, device="meta")})
    seen["meta_tracer"] = meta.code


def make_fx_modes(seen: _Seen) -> None:
    """make_fx in real, fake and symbolic modes, pre-dispatch, and a custom op with a data-dependent fake."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x):
        return torch.nn.functional.gelu(x).sum(0)

    for mode in ("real", "fake", "symbolic"):
        seen[f"make_fx_{mode}"] = make_fx(f, tracing_mode=mode)(_x()).code
    symbolic = make_fx(f, tracing_mode="symbolic")(_x())
    try:  # the fast symbol printer (torch 2.8+), then the class's own again
        seen["readable_fast_sympy"] = symbolic.print_readable(print_output=False, fast_sympy_print=True)
    except TypeError as exc:
        seen["readable_fast_sympy"] = str(exc)
    seen["readable_after"] = symbolic.print_readable(print_output=False)
    try:
        seen["pre_dispatch"] = make_fx(f, pre_dispatch=True)(_x()).code
    except TypeError as exc:  # torch 2.0: no pre_dispatch
        seen["pre_dispatch"] = str(exc)
    custom_op = getattr(torch.library, "custom_op", None)  # torch 2.4+
    if custom_op is not None:

        @custom_op("torchfix_equivalence::nonzero", mutates_args=())
        def nonzero(x: torch.Tensor) -> torch.Tensor:
            return x.nonzero()

        @nonzero.register_fake
        def _(x):
            return x.new_empty(torch.library.get_ctx().new_dynamic_size(), x.dim(), dtype=torch.int64)

        seen["custom_op"] = make_fx(nonzero, tracing_mode="symbolic")(torch.tensor([0.0, 1.0, 2.0])).code


def export_program(seen: _Seen) -> None:
    """torch.export (non-strict and strict), run_decompositions, save and load, draft_export."""
    from torch import export

    model, args = _MLP(), (_x(),)
    programs = {"non_strict": export.export(model, args, strict=False), "strict": export.export(model, args)}
    for name, program in programs.items():
        seen[f"{name}_graph"] = str(program.graph_module.code)
        seen.tensor(f"{name}_out", program.module()(*args))
    decomposed = programs["non_strict"].run_decompositions()
    seen["decomposed"] = str(decomposed.graph_module.code)
    seen["backends_after"] = [getattr(torch._C, f"_get_{name}_enabled")() for name in ("mkldnn", "nnpack", "cudnn")]
    buffer = io.BytesIO()
    export.save(decomposed, buffer)
    buffer.seek(0)
    seen.tensor("loaded_out", export.load(buffer).module()(*args))
    draft_export = getattr(export, "draft_export", None)  # torch 2.7+
    if draft_export is not None:
        seen["draft"] = str(draft_export(model, args).graph_module.code)


def attention_and_modes(seen: _Seen) -> None:
    """sdpa_kernel around eager SDPA and a compile; TorchFunctionMode, TorchDispatchMode and torch.device."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode, is_in_torch_dispatch_mode

    q = torch.randn(1, 2, 4, 8)
    attention = getattr(torch.nn, "attention", None)
    if attention is not None and hasattr(attention, "sdpa_kernel"):  # torch 2.3+
        with attention.sdpa_kernel(attention.SDPBackend.MATH):
            seen.tensor("sdpa_eager", torch.nn.functional.scaled_dot_product_attention(q, q, q))
            codes: list[str] = []
            compiled = torch.compile(torch.nn.functional.scaled_dot_product_attention, backend=_backend(codes))
            seen.tensor("sdpa_compiled", compiled(q, q, q))
            seen["sdpa_graphs"] = codes
        seen["math_after"] = torch.backends.cuda.math_sdp_enabled()

    class Count(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    class Record(TorchDispatchMode):
        ops: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Record.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with _compiles(seen):
        with Count():
            seen.tensor("under_function_mode", torch.compile(torch.cos, backend="eager")(torch.ones(2)))
        with torch.device("cpu"):
            seen.tensor("under_device", torch.compile(lambda: torch.ones(2) * 2, backend="eager")())
    seen["function_mode_calls"] = Count.calls
    with Record():
        seen["inside_dispatch_mode"] = is_in_torch_dispatch_mode()
        torch.ones(2).add(1)
    seen["dispatch_ops"] = Record.ops
    seen["outside_dispatch_mode"] = is_in_torch_dispatch_mode()


def autograd_apis(seen: _Seen) -> None:
    """checkpoint with its global overrides, allow_mutation_on_saved_tensors, compiled autograd, vmap."""
    from torch.utils import checkpoint

    model = _MLP()
    x = _x().requires_grad_()
    early_stop = getattr(checkpoint, "set_checkpoint_early_stop", None)  # torch 2.1+
    with early_stop(False) if early_stop is not None else contextlib.nullcontext():
        checkpoint.checkpoint(model, x, use_reentrant=False).sum().backward()
    seen.tensor("checkpoint_grad", x.grad)
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        a = torch.ones(3, requires_grad=True) * 1
        b = a.sin()
        a.mul_(2)
        b.sum().backward()
    seen.tensor("mutated_saved", a)
    compiled_autograd = getattr(torch._dynamo, "compiled_autograd", None)
    if compiled_autograd is not None and hasattr(compiled_autograd, "_enable"):
        model.zero_grad()
        with _compiles(seen), compiled_autograd._enable(torch.compile(backend="eager")):
            model(_x()).sum().backward()
            seen["in_region_after"] = bool(getattr(compiled_autograd, "in_compiled_autograd_region", False))
            with compiled_autograd._disable():  # what a compile inside it does
                seen["enabled_in_disable"] = compiled_autograd.compiled_autograd_enabled
            seen["enabled_after_disable"] = compiled_autograd.compiled_autograd_enabled
        seen.tensor("compiled_autograd_grad", model.fc1.weight.grad)
        seen["enabled_after"] = compiled_autograd.compiled_autograd_enabled
        captures = counters["compiled_autograd"]["captures"]
        model(_x()).sum().backward()
        seen["plain_backward_captures"] = counters["compiled_autograd"]["captures"] - captures
    seen.tensor("vmap", torch.vmap(torch.sin)(_x()))


def local_map_switches(seen: _Seen) -> None:
    """local_map's switches (torch 2.10+) read directly inside and after their context managers."""
    try:
        from torch._dynamo.variables.higher_order_ops import LocalMapWrappedHigherOrderVariable as Wrapped
        from torch._higher_order_ops import local_map
    except ImportError:
        return
    with local_map.defer_inlining():
        seen["deferred_inside"] = local_map._DEFER_INLINING
    from torch.distributed.tensor.experimental._func_map import _local_map_wrapped

    with Wrapped.enable():
        seen["wrapping_inside"] = [Wrapped._enabled, Wrapped.should_wrap_in_hop(_local_map_wrapped)]
    seen["after"] = [local_map._DEFER_INLINING, Wrapped._enabled, Wrapped.should_wrap_in_hop(_local_map_wrapped)]


def rnn_while_loop(seen: _Seen) -> None:
    """torch 2.11+: an LSTM exported and decomposed inside register_lstm_while_loop_decomposition(), as its docs show;
    the op's kernel, table entry and dispatch cache inside and after."""
    try:
        from torch.export._patches import register_lstm_while_loop_decomposition
    except ImportError:
        return
    from torch._decomp import global_decomposition_table

    op = torch.ops.aten.lstm.input

    def state() -> list[str]:
        kernel = op.py_kernels.get(torch._C.DispatchKey.CompositeImplicitAutograd)
        entry = global_decomposition_table["post_autograd"].get(op)
        cached = sorted(f"{key}: {getattr(value, '__name__', value)}" for key, value in op._dispatch_cache.items())
        return [getattr(kernel, "__name__", str(kernel)), getattr(entry, "__name__", str(entry)), *cached]

    lstm, x = torch.nn.LSTM(4, 8), torch.randn(3, 2, 4)
    seen["before"] = state()
    with register_lstm_while_loop_decomposition():
        program = torch.export.export(lstm, (x,))
        seen["inside"] = state()
        seen["graph"] = _plain(str(program.graph_module.code))
        seen["decomposed"] = _decomposed(program)
    seen["after"] = state()
    seen["decomposed_after"] = _decomposed(program)


def _decomposed(program: torch.export.ExportedProgram) -> str:
    """The decomposed program's code, or the error (2.13 rejects the while_loop LSTM's lifted constant)."""
    try:
        return _plain(str(program.run_decompositions().graph_module.code))
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"


def parametrize_cached(seen: _Seen) -> None:
    """A parametrized weight used twice inside parametrize.cached(), as its docs show, and trained after."""
    import torch.nn.utils.parametrize as P

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    P.register_parametrization(layer, "weight", Double())
    with P.cached():
        out = layer(_x()) + layer(_x())
        seen["inside"] = [P._cache_enabled, len(P._cache), layer.weight is layer.weight]
    out.sum().backward()
    seen.tensor("grad", layer.parametrizations.weight.original.grad)
    seen["after"] = [P._cache_enabled, len(P._cache), layer.weight is layer.weight]


def numpy_conversion(seen: _Seen) -> None:
    """torch._numpy's conversion of Python data, eager and as Dynamo traces np.array."""
    import numpy as np
    import torch._numpy as tnp

    array = tnp.asarray([1.5, 2.5])
    seen["eager"] = [str(array.tensor.dtype), str(torch.get_default_dtype())]
    codes: list[str] = []
    with _compiles(seen):
        compiled = torch.compile(lambda t: t + torch.from_numpy(np.array([1.5, 2.5])), backend=_backend(codes))
        seen.tensor("compiled", compiled(torch.zeros(2, dtype=torch.float64)))
    seen["codes"] = codes
    seen["default_after"] = str(torch.get_default_dtype())


def default_device(seen: _Seen) -> None:
    """torch.set_default_device around a compiled function that makes a tensor (graph, guards, recompiles), and
    what torch.utils._device.CURRENT_DEVICE reads inside and after."""
    import torch.utils._device as device_module

    codes: list[str] = []
    compiled = torch.compile(lambda x: x + torch.ones(2), backend=_backend(codes))
    with _compiles(seen):
        torch.set_default_device("meta")
        try:
            out = compiled(torch.ones(2))
            seen["inside"] = [str(out.device), repr(device_module.CURRENT_DEVICE), str(torch.get_default_device())]
        finally:
            torch.set_default_device(None)
        seen.tensor("after", compiled(torch.ones(2)))
    seen["codes"] = codes
    seen["after_device"] = repr(device_module.CURRENT_DEVICE)


def nested_ints(seen: _Seen) -> None:
    """Jagged nested tensors: their nested ints, an op across two of one offsets, and torch's counter after."""
    import torch.nested._internal.nested_tensor as nested

    offsets = torch.tensor([0, 2, 5])
    a = torch.nested.nested_tensor_from_jagged(torch.ones(5, 3), offsets)
    b = torch.nested.nested_tensor_from_jagged(torch.full((5, 3), 2.0), offsets)
    c = torch.nested.nested_tensor([torch.ones(1, 3), torch.ones(4, 3)], layout=torch.jagged)
    seen["shapes"] = [str(t.shape) for t in (a, b, c)]
    seen.tensor("sum", (a + b).values())
    seen["counter"] = nested._tensor_id_counter


def cuda_graphs(seen: _Seen) -> None:
    """CUDA only: torch.cuda.graph capture and replay, make_graphed_callables, a reduce-overhead training step."""
    x = torch.ones(8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        y = x * 2  # warm-up on a side stream, as the docs show
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        y = x * 2
    x.fill_(3)
    graph.replay()
    seen.tensor("replayed", y)
    model = _MLP().cuda()
    graphed = torch.cuda.make_graphed_callables(model, (torch.randn(4, 8, device="cuda", requires_grad=True),))
    seen.tensor("graphed", graphed(torch.ones(4, 8, device="cuda", requires_grad=True)))
    on_stream = torch.compile(lambda t: t * 2 if torch.cuda.current_stream() is not None else t, backend="eager")
    seen.tensor("stream_in_graph", on_stream(x))
    compiled = torch.compile(_MLP().cuda(), mode="reduce-overhead")
    for step in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        out = compiled(torch.ones(4, 8, device="cuda"))
        out.sum().backward()
        seen.tensor(f"reduce_overhead{step}", out)
        seen.tensor(f"reduce_overhead_grad{step}", compiled.fc1.weight.grad)
        compiled.zero_grad(set_to_none=True)  # the gradients are the graph's outputs: the next replay reuses them


def non_strict_backward(seen: _Seen) -> None:
    """A backward traced by make_fx inside torch.compiler._patch_engine_backward() (2.13+; before it,
    _patch_autograd_grad()) and _non_strict_tracing_context(), as non-strict tracers (torchtitan's) enter them."""
    compiler = torch.compiler
    patch = getattr(compiler, "_patch_engine_backward", None) or getattr(compiler, "_patch_autograd_grad", None)
    if patch is None:
        seen["skipped"] = "no autograd entry patches before torch 2.12"
        return
    from torch.fx.experimental.proxy_tensor import make_fx

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)

    def step(x: torch.Tensor) -> tuple:
        loss = model(x).pow(2).sum()
        return torch.autograd.grad(loss, [model.weight, model.bias])

    with compiler._non_strict_tracing_context(), patch():
        graph = make_fx(step)(torch.ones(3, 4))
    seen["graph"] = graph.code
    seen.tensor("grads", graph(torch.ones(3, 4)))
    seen.tensor("eager", step(torch.ones(3, 4)))


@dataclass(frozen=True)
class Case:
    run: Callable[[_Seen], None]
    cuda: bool = False  # runs on CUDA only


CASES = [
    Case(compile_function),
    Case(compile_training_step),
    Case(compile_inductor),
    Case(stance_and_disable),
    Case(symbolic_trace),
    Case(make_fx_modes),
    Case(export_program),
    Case(attention_and_modes),
    Case(autograd_apis),
    Case(local_map_switches),
    Case(rnn_while_loop),
    Case(parametrize_cached),
    Case(non_strict_backward),
    Case(numpy_conversion),
    Case(default_device),
    Case(nested_ints),
    Case(cuda_graphs, cuda=True),
]


def _fixes_by_code() -> dict:
    """The applied fixes by the code objects that run their patched code; empty on the side without torchfix."""
    installed = sys.modules.get("torchfix._install")
    return installed.fixes_by_code() if installed is not None else {}


def main(out: str, triggers: list[str]) -> None:
    """Import ``triggers`` (the parts of torch the fixes wait for: every fix this torch needs then applies on the side
    with torchfix), then run every case, each under ``cProfile`` on both sides (so that they differ by torchfix
    alone); on the side with torchfix, also write under ``FIXES_RUN`` which fixes' patched code each case ran and
    which fixes have any."""
    for trigger in triggers:
        with contextlib.suppress(ImportError):  # a part of torch this release lacks
            importlib.import_module(trigger)
    fixes_by_code = _fixes_by_code()
    results: dict[str, dict] = {}
    ran: dict[str, list[str]] = {}
    for case in CASES:
        if case.cuda and not torch.cuda.is_available():
            continue
        seen, profiler = _Seen(), cProfile.Profile()
        try:
            with profiler:
                case.run(seen)
        except Exception as exc:
            seen["error"] = _plain(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        results[case.run.__name__] = seen.found
        called = {entry.code for entry in profiler.getstats()}
        ran[case.run.__name__] = sorted({name for code in called for name in fixes_by_code.get(code, ())})
    if fixes_by_code:
        with_code = sorted({name for names in fixes_by_code.values() for name in names})
        results[FIXES_RUN] = {"cases": ran, "fixes with patched code": with_code}
    with open(out, "w") as f:
        json.dump(results, f, default=repr)
