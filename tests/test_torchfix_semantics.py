"""What must stay true after patching: Dynamo still folds the predicates, checkpoint recompute sees
the forward's flag (torch 2.14's behaviour), verify() catches a global access left behind."""

import re

import pytest
from conftest import FIXES, HAS_H1, HAS_H3, HAS_H5_FIX, SURVEYED, TORCH_VERSION, needs_fix, run_ok


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
flag_patch = next(patches[0] for fix, patches in _install._applied if fix.name == "fx-tracing-flag")
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


@needs_fix("backward-compile-deadlock")
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
        pytest.skip("backward-compile-deadlock does not patch this torch")
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


def test_a_non_recursive_disable_called_from_compiled_code_runs_eagerly(disabled):
    # torch.compiler.disable(f, recursive=False): Dynamo finds the wrapper by walking back over
    # convert_frame.py's frames (2.13+), so a frame torchfix added there (compile-cache-recheck's helper, until
    # 0.1.0) made it compile f instead: 0 where torch gives 2.
    ran = run_ok(
        """
import json
import torchfix, torch
compiler = getattr(torch, "compiler", None)
if not hasattr(compiler, "is_compiling") or "recursive" not in compiler.disable.__code__.co_varnames:
    print(json.dumps(None)); raise SystemExit  # no torch.compiler.is_compiling before 2.3
def inner(x):
    return x - 1 if compiler.is_compiling() else x + 1
wrapped = compiler.disable(inner, recursive=False)
@torch.compile(backend="eager")
def outer(f, x):
    return f(x)
print(json.dumps(outer(wrapped, torch.ones(3)).tolist()))
""",
        disable="compile-cache-recheck" if disabled else None,
        forked="torch",
    ).json()
    if ran is None:
        pytest.skip("torch.compiler has no is_compiling (or disable no recursive=) before 2.3")
    assert ran == [2.0, 2.0, 2.0]


# Every name a patch makes per thread (PerThreadName, declared by the patch), in one thread: read and written directly
# (by code outside torch's patched functions) and reset by torch's own API, with torchfix as without it. One
# interpreter per mode checks them all.
PER_THREAD_NAMES = r"""
import importlib, json, types
import torch, torchfix
from torchfix import _install, fixes
from torchfix._install import module_file_exists

for trigger in sorted({fix.trigger for fix in fixes.ALL}):  # the fixes that wait for a module apply with it
    if trigger == "torch" or module_file_exists(trigger):
        importlib.import_module(trigger)
version, applied = str(torch.__version__), dict(_install._applied)
declared = {  # the fixes this torch needs: what they make per thread, applied or not
    (name.module, name.name): (name, fix in applied, fix.name)
    for fix in fixes.ALL
    if fix in applied or (fix.supports(version) and fix.probe() is None)
    for patch in (applied.get(fix) or fix.patches(version))
    for name in patch.per_thread_names()
}

def owner(name):  # the module, or the class of a dotted name, and the attribute
    module = importlib.import_module(name.module)
    *path, attr = name.name.split(".")
    for part in path:
        module = getattr(module, part)
    return module, attr

def looks(value):  # JSON of a value, comparable between processes (objects by type)
    return value if isinstance(value, (bool, int, str, type(None))) else type(value).__name__

def other_than(value):
    return (not value) if isinstance(value, bool) else value - 1 if isinstance(value, int) else object()

found = {}
for (module_name, dotted), (name, patched, fix_name) in sorted(declared.items()):
    where, attr = owner(name)
    def seen():  # by torch's own code in this thread
        return name.seen_by_torch(importlib.import_module(module_name)) if patched else getattr(where, attr)
    original = getattr(where, attr)
    moved_global = isinstance(where, types.ModuleType) and attr not in vars(where)  # served by a module __getattr__
    row = {"read": looks(original), "torch_reads_it": seen() is original or seen() == original}
    written = other_than(original)
    setattr(where, attr, written)
    row["write"] = [getattr(where, attr) is written, seen() is written or seen() == written]
    if name.reset:
        exec(name.reset)
        row["reset"] = [looks(getattr(where, attr)), looks(seen())]
    if moved_global:  # back to the module __getattr__
        delattr(where, attr)
    else:
        setattr(where, attr, original)
    file = importlib.import_module(module_name).__file__.rsplit("/torch/", 1)[1]
    found[f"{module_name}.{dotted}"] = {
        "row": row, "written_unseen": bool(name.written_unseen) and patched, "fix": fix_name, "file": f"torch/{file}",
        "name": dotted,
    }
print(json.dumps(found))
"""


def test_every_per_thread_name_reads_writes_and_resets_in_one_thread_as_without_torchfix():
    fixed, plain = (run_ok(PER_THREAD_NAMES, disable=off, forked="triggers").json() for off in (None, "1"))
    assert fixed.keys() == plain.keys(), (sorted(fixed), sorted(plain))
    counters = set()
    if TORCH_VERSION.release >= (2, 1):  # CUDA graph trees
        counters = {"torch._dynamo.mutation_guard.GenerationTracker.generation"}
        counters.add("torch._inductor.cudagraph_trees.MarkStepBox.mark_step_counter")
    assert counters <= fixed.keys(), sorted(fixed)
    unseen = {name for name, found in fixed.items() if found["written_unseen"]}
    for name, found in fixed.items():
        row, without = found["row"], plain[name]["row"]
        if name in unseen:  # declared: a direct write does not reach torch's patched code (PerThreadName)
            assert row["write"] == [True, False] and without["write"] == [True, True], (name, row, without)
            row, without = {**row, "write": None}, {**without, "write": None}
        assert row == without, (name, row, without)
    assert not counters & unseen
    if TORCH_VERSION.release[:2] == SURVEYED:
        # The survey's verdicts are written from the fixes' survey_rows: on the release it read, each name a fix
        # makes per thread is in a row that fix names ("module[, module]: name[, name]").
        rows = {fix["name"]: fix["survey_rows"] for fix in FIXES}
        unnamed = [name for name, found in fixed.items() if not in_a_survey_row(found, rows[found["fix"]])]
        assert not unnamed, f"no survey row that their fix names holds these: {unnamed}"


def in_a_survey_row(found: dict, rows: list[str]) -> bool:
    for row in rows:
        modules, names = row.split(": ", 1)
        if found["file"] in (m.strip() for m in modules.split(",")) and found["name"] in re.split(r"[,/ ]+", names):
            return True
    return False


CUDA_GRAPH_COUNTERS = r"""
import json, threading
import torchfix, torch
from torch._dynamo.mutation_guard import GenerationTracker
from torch._inductor import cudagraph_trees
from torch._inductor.cudagraph_trees import CUDAGraphTreeManager, MarkStepBox

def read():  # what the trees of the calling thread go by, and the class attributes
    return [CUDAGraphTreeManager.get_curr_generation(), CUDAGraphTreeManager.user_invoked_mark_step(),
            GenerationTracker.generation, MarkStepBox.mark_step_counter]

compiled = torch.compile(lambda x: x + 1, backend="eager")
steps = {
    "compiled call": lambda: compiled(torch.ones(2)),
    "generation -= 1": lambda: setattr(GenerationTracker, "generation", GenerationTracker.generation - 1),
    "torch._dynamo.reset()": torch._dynamo.reset,
    "mark step": torch.compiler.cudagraph_mark_step_begin,
    "mark_step_counter = -7": lambda: setattr(MarkStepBox, "mark_step_counter", -7),
    "reset_cudagraph_trees()": cudagraph_trees.reset_cudagraph_trees,
    "mark_step_counter = 0": lambda: setattr(MarkStepBox, "mark_step_counter", 0),
}
one_thread = []
for step in ["compiled call", "generation -= 1", "compiled call", "torch._dynamo.reset()", "compiled call",
             "mark step", "mark_step_counter = -7", "mark step", "reset_cudagraph_trees()", "mark_step_counter = 0"]:
    steps[step]()
    one_thread.append([step, *read()])

# Another thread with counters of its own reads its trees' generation while this one runs torch's own steps
# (no direct writes): it must not move.
ready, done, other = threading.Event(), threading.Event(), []
def elsewhere():
    compiled(torch.ones(2))
    other.append(read()[:2])
    ready.set(); done.wait(60)
    other.append(read()[:2])
thread = threading.Thread(target=elsewhere)
thread.start(); ready.wait(60)
for step in ["compiled call", "mark step", "torch._dynamo.reset()", "reset_cudagraph_trees()", "mark step"]:
    steps[step]()
done.set(); thread.join(60)
print(json.dumps({"one_thread": one_thread, "other_moved": other[0] != other[1]}))
"""


@pytest.mark.skipif(TORCH_VERSION.release < (2, 1), reason="CUDA graph trees from torch 2.1")
def test_cuda_graph_counters_written_directly_reach_the_trees_of_one_thread_as_without_torchfix():
    # cudagraph-step-counters: torch's tests write GenerationTracker.generation -= 1 between two compiled calls to
    # keep the second in the first's generation (test_checkpointing_resets_persistent_refs); in one thread the
    # trees must read what they read without torchfix, whatever wrote the counters; across threads, not move.
    # Forked: the child ends with os._exit. A fresh interpreter's own exit crashed once on 2.10 (CI, "terminate
    # called without an active exception", after the script's output), not reproduced in 26 runs since.
    fixed, plain = (
        run_ok(CUDA_GRAPH_COUNTERS, forked="triggers", disable=off).json() for off in (None, "cudagraph-step-counters")
    )
    assert fixed["one_thread"] == plain["one_thread"], (fixed, plain)
    first_call, written = plain["one_thread"][:2]
    assert written[1] == first_call[1] - 1, plain  # the direct write is seen
    assert not fixed["other_moved"] and plain["other_moved"], (fixed, plain)


CALLABLES_PER_TREE = """
import gc, json, threading, weakref
import torchfix, torch
from torch._inductor import cudagraph_trees
from torchfix.fixes.cudagraph_tree_callable import PerTree
from torchfix.patching.stash import stash_until_thread_end
made = []  # the trees the callables were made for, weakly
def make(model, inputs, static_input_idxs, **kwargs):  # what compile_fx's cudagraphify_impl is called with
    made.append(weakref.ref(cudagraph_trees.get_container(kwargs["device_index"])))
    return lambda new_inputs, number=len(made) - 1: number  # which tree the callable was made for
per_tree = PerTree()
dispatch = per_tree(make, None, [], (), device_index=0)
mine = [dispatch([]), dispatch([])]
main_containers = cudagraph_trees.local.tree_manager_containers
def own_trees():
    seen.append([dispatch([]), dispatch([])])
def device_thread_of_main():  # autograd's device thread sees the stash of the thread whose backward it runs
    stash_until_thread_end("tree_manager_containers", main_containers)
    seen.append([dispatch([])])
seen = []
for target in (own_trees, device_thread_of_main):
    thread = threading.Thread(target=target)
    thread.start()
    thread.join(60)
gc.collect()
alive = [tree() is not None for tree in made]
print(json.dumps({"main": mine, "threads": seen, "alive": alive, "kept": len(per_tree._by_tree)}))
"""


@needs_fix("cudagraph-tree-callable")
def test_a_graphs_cuda_graph_callables_are_one_per_tree():
    # cudagraph-tree-callable's dispatcher (no GPU: a stand-in for the CUDA-graph callable it makes): a thread's
    # replays reuse the callable made for its tree, another thread's trees get their own, a device thread running
    # the main thread's backward (its stash) gets the main thread's, and an ended thread's callable goes with it.
    seen = run_ok(CALLABLES_PER_TREE, forked="triggers").json()
    assert seen == {"main": [0, 0], "threads": [[1, 1], [0]], "alive": [True, False], "kept": 1}, seen


ONE_THREAD_SWITCHES = """
import json
import torchfix, torch
from torch.nn.attention import SDPBackend, sdpa_kernel
M, F, E = SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION
seen = []
def record(step):
    c = torch._C
    sdp = [c._get_flash_sdp_enabled(), c._get_mem_efficient_sdp_enabled(), c._get_math_sdp_enabled()]
    priority = torch._C._get_sdp_priority_order() if hasattr(torch._C, "_get_sdp_priority_order") else None
    backends = [torch.backends.mkldnn.enabled, torch._C._get_nnpack_enabled(), torch.backends.cudnn.enabled,
                torch.backends.cudnn.deterministic]
    seen.append([step, sdp, priority, backends])
with sdpa_kernel(M):  # nested, and the user's own settings inside
    record("math")
    with sdpa_kernel([F, E]):
        record("flash+efficient")
        torch.backends.cuda.enable_math_sdp(True)
        record("math enabled inside")
    record("back to math")
    torch.backends.cuda.enable_flash_sdp(True)
record("after")
try:
    with sdpa_kernel([M, F], set_priority=True):
        record("priority")
    record("after priority")
    with sdpa_kernel(["not a backend"], set_priority=True):
        pass
except Exception as exc:
    seen.append(type(exc).__name__)
record("after a bad backend")

class Model(torch.nn.Module):
    def forward(self, x):
        record("in export")
        torch.backends.mkldnn.enabled = True  # the model's own setting of a switch the export changes
        torch.backends.cudnn.deterministic = False  # one it does not change
        return x + 1
torch.backends.cudnn.deterministic = True
torch.export.export(Model(), (torch.ones(2),), strict=False)
record("after export")
torch.backends.cudnn.deterministic = True

@torch.compile(backend="eager")
def compiled(x):
    with sdpa_kernel(M):
        return torch.nn.functional.scaled_dot_product_attention(x, x, x)
compiled(torch.ones(1, 1, 4, 8))
record("after a compiled sdpa_kernel")
print(json.dumps(seen))
"""


@pytest.mark.skipif(TORCH_VERSION.release < (2, 3), reason="no sdpa_kernel, nor export's backend switches, before 2.3")
def test_switch_overrides_in_one_thread_are_torchs():
    # sdpa_kernel (nested, with the user's settings inside, with a priority, with a bad backend), an export whose
    # model sets a switch the export changed, and sdpa_kernel in compiled code: the same switches at every step.
    # The one difference: a setting the export does not change (cudnn.deterministic), made by the model while it is
    # exported, stays after it; torch 2.11+ writes back cudnn's whole saved tuple (what undoes other threads' settings).
    with_fix, without = (run_ok(ONE_THREAD_SWITCHES, disable=disable, forked="torch").json() for disable in (None, "1"))
    after_export = [step[0] for step in without].index("after export")
    torch_undoes_it = TORCH_VERSION.release >= (2, 11)
    assert (with_fix[after_export][3][3], without[after_export][3][3]) == (False, torch_undoes_it)
    with_fix[after_export][3][3] = torch_undoes_it
    assert with_fix == without


@pytest.mark.skipif(TORCH_VERSION.release < (2, 5), reason="export-decomp-kernels patches torch 2.5+")
def test_run_decompositions_in_one_thread_makes_torchs_graphs():
    # export-decomp-kernels gives the decomposing thread its own kernel tables: in one thread, run_decompositions'
    # graphs must be torch's (the same process after torchfix.uninstall()), and the ops' tables torch's own after.
    ran = run_ok(
        """
import json
import torchfix, torch
aten = torch.ops.aten
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.norm, self.linear = torch.nn.Conv2d(2, 3, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2)
    def forward(self, x):
        x = self.norm(self.conv(x).permute(0, 2, 3, 1))
        return torch.nn.functional.gelu(self.linear(x)).to(torch.float64)
program = torch.export.export(Model(), (torch.randn(1, 2, 5, 5),))
def keep_linear():
    table = getattr(torch.export, "default_decompositions", None)  # 2.6+
    if table is None:
        return {}
    table = table()
    del table[aten.linear.default]
    return table
def graphs():
    return [program.run_decompositions().graph_module.code, program.run_decompositions(keep_linear()).graph_module.code]
ops = (aten.linear.default, aten.layer_norm.default, aten.to.dtype)
tables = [(op, op.py_kernels, dict(op.py_kernels), op._dispatch_cache) for op in ops]
fixed = graphs()
seen = {"status": next(s.state.value for s in torchfix.status() if s.name == "export-decomp-kernels")}
seen["tables_after"] = all(
    op.py_kernels is kernels and kernels == saved and op._dispatch_cache is cache
    for op, kernels, saved, cache in tables
)
torchfix.uninstall()
seen["same_graphs"] = graphs() == fixed
print(json.dumps(seen))
""",
        forked="torch",
    ).json()
    assert ran == {"status": "applied", "tables_after": True, "same_graphs": True}


@pytest.mark.skipif(TORCH_VERSION.release < (2, 4), reason="neither fix applies before torch 2.4")
def test_modes_in_one_thread_trace_and_answer_as_torch_does():
    # function-mode-stack and dispatch-mode-flags in one thread: the same graphs, frames and recompiles for code
    # compiled inside a TorchFunctionMode and a torch.device context (and aot_compile'd inside one), the same
    # is_in_torch_dispatch_mode() answers, the same exports, with the fixes as without; and removed in another
    # thread, the fix leaves torch_function the manager that convert_frame imported.
    ran = run_ok(
        """
import json, threading
import torch, torch._dynamo, torchfix
from torchfix import fixes
from torchfix._fix import revert_all
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _python_dispatch as dispatch

class Function(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

class Dispatch(dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

class Module(torch.nn.Module):
    def forward(self, x):
        return torch.ones(2) + x.relu()

def in_dispatch_modes():
    answers = [dispatch.is_in_torch_dispatch_mode()]
    with Dispatch():
        answers.append(dispatch.is_in_torch_dispatch_mode())
        with FakeTensorMode():
            answers.append(str(torch.ones(2, 3).sin().shape))
            answers.append(dispatch.is_in_torch_dispatch_mode())
    with FakeTensorMode():
        answers.append(dispatch.is_in_torch_dispatch_mode())
    return answers + [dispatch.is_in_torch_dispatch_mode()]

def workload():
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward
    compiled = torch.compile(lambda x: torch.ones(2) + x.sin(), backend=backend)
    with Function():
        compiled(torch.ones(2)), compiled(torch.ones(2))
    compiled(torch.ones(2))
    with torch.device("cpu"):
        compiled(torch.ones(2)), compiled(torch.ones(2))
    with Function(), torch.device("meta"):
        seen = {"device": str(compiled(torch.ones(2)).device)}
    if getattr(torch._dynamo.config, "enable_aot_compile", False):  # on by default from 2.12
        with Function():
            aot = torch.compile(lambda x: x.cos() * 2, fullgraph=True, backend="eager")
            seen["aot_compile"] = aot.aot_compile(((torch.ones(2),), {}))(torch.ones(2)).tolist()
            seen["modes after aot_compile"] = torch._C._len_torch_function_stack()
    seen["in dispatch modes"] = in_dispatch_modes()
    seen["export"] = torch.export.export(Module(), (torch.ones(2),)).graph_module.code
    seen["counters"] = {k: dict(counters[k]) for k in ("frames", "stats", "graph_break", "recompiles")}
    return {**seen, "graphs": graphs}

version = str(torch.__version__)
before = workload()
by_name = {fix.name: fix for fix in fixes.ALL}
applied = {name: by_name[name].apply(version) for name in ("function-mode-stack", "dispatch-mode-flags")}
after = workload()
import torch._dynamo.convert_frame as convert_frame, torch._dynamo.variables.torch_function as torch_function
name = "torch_function_mode_stack_state_mgr"  # 2.6+
manager = vars(convert_frame).get(name)
remover = threading.Thread(target=revert_all, args=(applied["function-mode-stack"][1],))
remover.start(); remover.join()
revert_all(applied["dispatch-mode-flags"][1])
print(json.dumps({
    "states": {name: status.state.value for name, (status, _) in applied.items()},
    "changed": sorted(key for key in before if before[key] != after[key]),
    "manager is convert_frame's after removal": getattr(torch_function, name, None) is manager,
    "graphs": len(before["graphs"]),
}))
""",
        disable="1",
        forked="torch",
    ).json()
    assert ran["changed"] == [] and ran["manager is convert_frame's after removal"], ran
    assert ran["graphs"] >= 2, ran  # compiled inside the mode, and again outside it (the mode-stack guard)
    assert ran["states"]["dispatch-mode-flags"] == "applied", ran


ONE_STASH_ENTRY = """
import json, torchfix, torch
from torchfix.patching import stash
torch.compile(torch.nn.Linear(4, 4), backend="aot_eager")(torch.ones(2, 4)).sum().backward()
spaces = torch._C._get_obj_in_tls(stash.SPACES)
entries, probe = sum(torch._C._is_key_in_tls(k) for k in spaces), torch._C._is_key_in_tls(stash.PROBE)
print(json.dumps({"namespaces": len(spaces), "entries_of_their_own": entries, "probe": probe}))
"""


@pytest.mark.skipif(TORCH_VERSION.release < (2, 13), reason="torchfix keeps namespaces in torch's stash from 2.13")
def test_a_threads_namespaces_are_one_entry_of_torchs_stash():
    """autograd copies the whole C++ stash at every node of a backward, so torchfix's per-thread namespaces
    (ThreadSpaces) share one entry per thread (docs/measured.md, "An eager backward and the stash"), and the probe of
    how the stash keeps references leaves none of its own."""
    seen = run_ok(ONE_STASH_ENTRY, forked="triggers").json()
    assert seen["namespaces"] > 5 and seen["entries_of_their_own"] == 0 and not seen["probe"], seen
