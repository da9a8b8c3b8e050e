"""What must stay true after patching: Dynamo still folds the predicates, checkpoint recompute sees
the forward's flag (torch 2.14's behaviour), verify() catches a global access left behind."""

import pytest
from conftest import HAS_H1, HAS_H3, HAS_H5_FIX, TORCH_VERSION, run_ok


def test_fullgraph_compile_folds_the_predicates(disabled):
    ran = run_ok(
        """
import json
import torchfix, torch
import torch.fx._symbolic_trace as st
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters
is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)  # torch 2.3+
symbolic = getattr(st, "is_fx_symbolic_tracing", None)

def f(x):
    x = x + (1 if is_compiling is None or is_compiling() else 1000)
    x = x + (10000 if st.is_fx_tracing() else 0)
    # An import inside compiled code hands Dynamo the patched module itself: it must still be a plain
    # module to Dynamo (some releases check `type(m) is ModuleType`).
    from torch.fx._symbolic_trace import is_fx_tracing
    x = x + (10000 if is_fx_tracing() else 0)
    return x + (10000 if symbolic is not None and symbolic() else 0)

counter = CompileCounter()
y = torch.compile(f, backend=counter, fullgraph=True)(torch.zeros(2))
print(json.dumps({"y": y.tolist(), "frames": counter.frame_count,
                  "graph_breaks": sum(counters["graph_break"].values())}))
""",
        disable="1" if disabled else None,
        forked="torch",
    ).json()
    assert ran == {"y": [1.0, 1.0], "frames": 1, "graph_breaks": 0}


@pytest.mark.parametrize("forward_flag", [True, False])
def test_checkpoint_recompute_sees_the_forward_flag(forward_flag):
    # Forward in one thread with the flag set one way, backward (and so recompute) in another thread
    # with it set the other way: recompute must see the forward's value, as torch 2.14 does.
    ran = run_ok(
        f"""
import json, threading
import torchfix, torch
import torch.fx._symbolic_trace as st
from torch.utils.checkpoint import checkpoint
seen = []
def fn(x):
    seen.append(st._get_is_fx_tracing())
    return x.sin()
x = torch.ones(3, requires_grad=True)
out = {{}}
def forward():
    with st._is_fx_tracing_context({forward_flag}):
        out["y"] = checkpoint(fn, x, use_reentrant=False)
thread = threading.Thread(target=forward)
thread.start(); thread.join()
with st._is_fx_tracing_context({not forward_flag}):
    out["y"].sum().backward()
print(json.dumps(seen))
""",
        forked="torch",
    ).json()
    assert ran == [forward_flag, forward_flag]


@pytest.mark.skipif(not HAS_H1, reason="the fix is not needed on torch 2.14+")
def test_verify_finds_a_global_access_left_behind():
    ran = run_ok(
        """
import json
import torch, torchfix
from torchfix import _install
import torch.fx._symbolic_trace as st
flag_patch = _install._applied[0][1][0]
flag_patch.verify()  # clean after install
exec("def sneaky():\\n    return _is_fx_tracing_flag\\n", vars(st))  # a function the patch never saw
st.sneaky.__module__ = st.__name__
st.sneaky.__code__ = st.sneaky.__code__.replace(co_filename=st.__file__)
try:
    flag_patch.verify()
    print(json.dumps("not caught"))
except Exception as exc:
    print(json.dumps(str(exc)))
""",
        forked="torch",
    ).json()
    assert "sneaky: LOAD_GLOBAL _is_fx_tracing_flag" in ran


@pytest.mark.skipif(not HAS_H1, reason="the fix is not needed on torch 2.14+")
def test_fast_reads_follow_every_thread_value():
    # Reads skip the per-thread storage while no thread holds a value of its own; they must still see
    # each thread's value, a value set before the install stays that thread's, and the count drains.
    ran = run_ok(
        """
import json, threading
import torch
import torch.fx._symbolic_trace as st
st._is_fx_tracing_flag = True  # stuck before the install
import torchfix
from torchfix.fixes.fx_tracing_flag import many_threads
holder = st._is_fx_tracing_tls
def elsewhere():
    seen = []
    thread = threading.Thread(target=lambda: seen.append(st.is_fx_tracing()))
    thread.start(); thread.join()
    return seen[0]
seen = {"installer": st.is_fx_tracing(), "new_thread": elsewhere(), "count": holder.overridden}
st._set_is_fx_tracing(False)
seen["after_reset"] = [st.is_fx_tracing(), holder.overridden]
many_threads(rounds=4, callers=3)  # traces in threads set and restore their own values
seen["after_traces"] = holder.overridden
print(json.dumps(seen))
""",
        forked="torch",
    ).json()
    assert ran == {"installer": True, "new_thread": False, "count": 1, "after_reset": [False, 0], "after_traces": 0}


def test_joint_trace_backward_sees_is_compiling_in_the_compiling_thread(disabled):
    # What runs for a compile but is not traced by Dynamo (a custom op's fake kernel, and its backward
    # formula run by torch.autograd.grad while AOTAutograd traces the joint graph) must still see
    # is_compiling() True. The backward formula runs on the compiling thread, where the value lives, on
    # every device: AOTAutograd traces with autograd multithreading off, so CUDA's device thread is not
    # used either (checked here through the engine's switch; on CPU the calling thread runs it anyway).
    ran = run_ok(
        """
import json, threading
import torchfix, torch
if not hasattr(torch.library, "custom_op"):
    print(json.dumps(None)); raise SystemExit
seen = set()
@torch.library.custom_op("torchfix_test::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2
@double.register_fake
def _(x):
    seen.add(("fake", threading.current_thread().name, torch.compiler.is_compiling()))
    return torch.empty_like(x)
def backward(ctx, grad):
    seen.add(("backward", threading.current_thread().name, torch.compiler.is_compiling()))
    seen.add(("backward: autograd multithreading", torch._C._is_multithreading_enabled()))
    return grad * 2
double.register_autograd(backward)
compiled = torch.compile(lambda x: double(x).sum(), backend="aot_eager")
thread = threading.Thread(target=lambda: compiled(torch.ones(3, requires_grad=True)), name="compiler")
thread.start(); thread.join()
print(json.dumps(sorted(seen)))
""",
        disable="compiler-flags" if disabled else None,
        forked="torch",
    ).json()
    if ran is None:
        pytest.skip("torch.library.custom_op needs torch 2.4+")
    compiling = HAS_H3  # before 2.13 only export paths set the flag
    assert ran == [
        ["backward", "compiler", compiling],
        ["backward: autograd multithreading", False],
        ["fake", "compiler", compiling],
    ]


def test_set_compilation_env_clears_the_flag_of_its_own_thread():
    # _set_compilation_env writes the flag as a module attribute from another module: that write must
    # reach the calling thread's flag (torch 2.2+; 2.14+ does this upstream).
    ran = run_ok(
        """
import json
import torchfix, torch
import torch.fx._symbolic_trace as st
from torchfix.fixes.fx_tracing_flag import _find_set_compilation_env
set_compilation_env = _find_set_compilation_env()
if set_compilation_env is None:
    print(json.dumps(None)); raise SystemExit
with st._is_fx_tracing_context(True):
    with set_compilation_env():
        inside = st._get_is_fx_tracing()
    after = st._get_is_fx_tracing()
print(json.dumps([inside, after]))
""",
        forked="torch",
    ).json()
    if ran is None:
        pytest.skip("no _set_compilation_env before torch 2.2")
    assert ran == [False, True]


@pytest.mark.skipif(not HAS_H5_FIX, reason="no H5 before torch 2.6: the backward compiler takes no lock")
def test_backward_is_compiled_with_the_forward_in_every_thread(disabled):
    # The H5 fix: a backward graph is compiled inside the forward compile (under the lock it holds), not
    # lazily on autograd's device thread; in threads started before `import torchfix` too.
    ran = run_ok(
        """
import json, threading
import torch
from torch._dynamo.backends.common import aot_autograd
compiled = []
def record(kind):
    def compiler(graph, example_inputs):
        compiled.append(kind)
        return graph.forward
    return compiler
backend = aot_autograd(fw_compiler=record("forward"), bw_compiler=record("backward"))
imported = threading.Event()
seen = {}
def worker():
    imported.wait()
    step = torch.compile(lambda w, x: (w * x).sin().sum(), backend=backend)
    loss = step(torch.ones(4, requires_grad=True), torch.ones(4))
    seen["before_backward"] = list(compiled)
    loss.backward()
thread = threading.Thread(target=worker)
thread.start()
import torchfix
imported.set()
thread.join()
print(json.dumps(seen["before_backward"]))
""",
        disable="backward-compile-deadlock" if disabled else None,
        forked="torch",
    ).json()
    assert ran == (["forward"] if disabled else ["forward", "backward"])


def test_backward_compile_fix_applies_when_a_threads_first_compile_imports_aot_autograd():
    # backward-compile-deadlock waits for AOTAutograd (not imported by `import torch`): a thread's first compile
    # imports it, and that compile's backward must already be compiled with its forward.
    ran = run_ok(
        """
import json, sys, threading
import torch, torchfix
pending = "torch._functorch.aot_autograd" not in sys.modules
state = lambda: next(s.state.value for s in torchfix.status() if s.name == "backward-compile-deadlock")
seen = {"before": state()}
def worker():
    from torch._dynamo.backends.common import aot_autograd
    compiled = []
    def record(kind):
        def compiler(graph, example_inputs):
            compiled.append(kind)
            return graph.forward
        return compiler
    backend = aot_autograd(fw_compiler=record("forward"), bw_compiler=record("backward"))
    step = torch.compile(lambda w, x: (w * x).sin().sum(), backend=backend)
    step(torch.ones(4, requires_grad=True), torch.ones(4))
    seen["compiled before backward"] = compiled
thread = threading.Thread(target=worker)
thread.start(); thread.join()
seen["after"] = state()
print(json.dumps([pending, seen]))
""",
        forked="torch",
    ).json()
    pending, seen = ran
    if not HAS_H5_FIX:
        pytest.skip("before torch 2.6 the fix is not needed")
    assert pending and seen["before"] == "pending import", ran
    assert seen["after"] == "applied" and seen["compiled before backward"] == ["forward", "backward"], ran


def test_allow_mutation_on_saved_tensors_in_one_thread_is_torchs(disabled):
    # saved-tensor-mutation splits torch's flag into a per-thread one and the context's own: in one thread,
    # what a user sees must not change (the mutated tensor's saved value, the nesting error, backward after exit).
    ran = run_ok(
        """
import json
import torchfix, torch
import torch.autograd.graph as graph
seen = {}
def record():
    leaf = torch.ones(3, requires_grad=True)
    x = leaf.clone()
    y = x.sin().sum()
    x.add_(1.0)
    return leaf, y
def outcome(fn):
    try:
        fn()
        return "ran"
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:40]}"
with graph.allow_mutation_on_saved_tensors():
    seen["inside"] = graph._allow_mutation_on_saved_tensors_enabled
    leaf, y = record()
    y.backward()
    seen["gradient"] = torch.allclose(leaf.grad, torch.ones(3).cos())
    leaf, late = record()
def nested():
    with graph.allow_mutation_on_saved_tensors():
        with graph.allow_mutation_on_saved_tensors():
            pass
seen["nested"] = outcome(nested)
seen["after"] = graph._allow_mutation_on_saved_tensors_enabled
seen["backward_after_exit"] = outcome(late.backward)
print(json.dumps(seen))
""",
        disable="saved-tensor-mutation" if disabled else None,
        forked="torch",
    ).json()
    assert ran == {
        "inside": True,
        "gradient": True,
        "nested": "RuntimeError: allow_mutation_on_saved_tensors contexts",
        "after": False,
        "backward_after_exit": "AssertionError: Trying to backward outside of the 'allow",
    }


def test_user_object_tables_are_the_modules_own_again_after_uninstall_in_another_thread():
    # graph-user-objects: output_graph (and, 2.14+, runtime_wrappers) hold the tables by name, as imported; the
    # fix applied in a thread that first imported Dynamo and removed in the main thread must leave the module the
    # very objects they hold, or every graph with user objects raises "Index not registered" after uninstall.
    ran = run_ok(
        """
import json, sys, threading
import torch, torchfix
thread = threading.Thread(target=lambda: __import__("torch._dynamo"))
thread.start(); thread.join()
states = {s.name: s.state.value for s in torchfix.status()}
torchfix.uninstall()
tables = sys.modules.get("torch._dynamo.graph_bytecode_inputs")
aliases = [(sys.modules[user], name) for user, name in [
    ("torch._dynamo.output_graph", "index_to_bytecode_constructor"),
    ("torch._functorch._aot_autograd.runtime_wrappers", "index_to_external_object_weakref"),
] if tables is not None and name in vars(sys.modules.get(user, object))]
print(json.dumps([states["graph-user-objects"], [getattr(m, n) is getattr(tables, n) for m, n in aliases]]))
""",
        forked="torch",
    ).json()
    if ran[0] != "applied":
        pytest.skip("graph-user-objects does not apply to this torch")
    assert ran[1] and all(ran[1]), ran


@pytest.mark.skipif(TORCH_VERSION.release < (2, 10), reason="torch has _in_optimized_module from 2.10")
def test_a_plain_thread_local_holder_keeps_each_threads_value():
    # optimized-module-flag's holder is a plain threading.local (no call per access): a value set before the
    # install stays the installing thread's, a new thread reads the file's default, `module.NAME` reads the
    # caller's, and uninstalling makes the caller's value the global again.
    ran = run_ok(
        """
import json, threading
import torch
from torch._dynamo import eval_frame as ef
ef._in_optimized_module = True  # stuck before the install
import torchfix
def elsewhere():
    seen = []
    def read():
        with ef._set_in_optimized_module():
            inside = ef._is_in_optimized_module()
        seen.append([inside, ef._is_in_optimized_module(), ef._in_optimized_module])
    thread = threading.Thread(target=read)
    thread.start(); thread.join()
    return seen[0]
seen = {"installer": [ef._is_in_optimized_module(), ef._in_optimized_module], "new_thread": elsewhere()}
torchfix.uninstall()
seen["global_after_uninstall"] = vars(ef)["_in_optimized_module"]
print(json.dumps(seen))
""",
        forked="torch",
    ).json()
    assert ran == {"installer": [True, True], "new_thread": [True, False, False], "global_after_uninstall": True}
