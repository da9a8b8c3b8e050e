"""H1 - H4 and cold-start duplicate compiles, forced with events, each with torchfix and with its fix
disabled (TORCHFIX_DISABLE).

Without torchfix the hazard must show on every torch that has it (a test that passes either way
proves nothing); with torchfix it must be gone.
"""

import pytest
from conftest import (
    HAS_CACHED_OPS,
    HAS_EXPORT_BUILTINS,
    HAS_EXPORT_LOAD,
    HAS_EXPORT_SAVE,
    HAS_EXPORT_TRACE,
    HAS_FAKE_IMPL_CTX,
    HAS_H1,
    HAS_H2,
    HAS_H3,
    HAS_H4,
    HAS_H6,
    HAS_H7_COUNTERS,
    HAS_H7_TREES,
    HAS_H7_TREES_AT_END,
    HAS_MAKE_FX_TRACER,
    HAS_NODE_META,
    HAS_PER_THREAD_GUARDED_BACKENDS,
    HAS_PRE_DISPATCH_MODES,
    HAS_RECHECK_FIX,
    HAS_STANCE,
    TORCH_CRASHES_ON_CONCURRENT_MAKE_FX,
    TORCH_CRASHES_ON_CONCURRENT_RECOMPILE,
    run_ok,
    run_python,
)

SCENARIO = """
import dataclasses, json, os, sys
import torchfix, torch
from torchfix import _selftest
result = {call}
print(json.dumps(dataclasses.asdict(result) if result else None), flush=True)
os._exit(0)  # torch 2.3's interpreter teardown after a threaded compile can abort or hang, fix or not
"""


def scenario(call: str, disabled: bool, fix: str = "1") -> dict:
    """Run a self-test scenario; ``disabled`` turns off ``fix`` (all fixes by default)."""
    return run_ok(SCENARIO.format(call=call), disable=fix if disabled else None).json()


@pytest.mark.parametrize("tracer", ["symbolic_trace", "make_fx"])
def test_h1_trace_in_one_thread_breaks_compiled_call_in_another(tracer, disabled):
    result = scenario(f"_selftest.h1_nested_trace_error({tracer!r})", disabled)
    assert result["hazard"] == (disabled and HAS_H1), result


def test_h2_set_compilation_env_leaves_flag_stuck(disabled):
    result = scenario("_selftest.h2_stuck_flag()", disabled)
    if result is None:
        pytest.skip("this torch has no _set_compilation_env (H2 needs torch 2.2+)")
    assert result["hazard"] == (disabled and HAS_H2), result


def test_many_threads_calling_while_another_traces(disabled):
    result = scenario("_selftest.many_threads(rounds=12, callers=6)", disabled)
    assert result["hazard"] == (disabled and HAS_H1), result
    if disabled and HAS_H1:
        assert result["detail"].startswith("72 of 72"), result  # every call landed inside a trace


def test_h3_compile_in_one_thread_makes_is_compiling_true_in_another(disabled):
    result = scenario("_selftest.h3_is_compiling_elsewhere()", disabled, fix="compiler-flags")
    if result is None:
        pytest.skip("this torch has no torch.compiler.is_compiling (H3 needs torch 2.3+)")
    assert result["hazard"] == (disabled and HAS_H3), result
    if HAS_H3:  # the compiling thread itself still sees True, fix or not
        assert result["detail"].endswith("(in the compiling thread: True)"), result


# State one thread sets while another works (a scenario of _selftest each): (scenario, its fix, whether this
# torch has the hazard, what a torch whose scenario answers None lacks, what the disabled run must show).
STATE_ELSEWHERE = [
    ("stance_elsewhere", "compile-stance", HAS_STANCE, "torch.compiler.set_stance (2.6+)", ""),
    ("node_meta_elsewhere", "fx-node-meta", HAS_NODE_META, "", ""),
    ("guarded_backends_elsewhere", "guarded-backends", HAS_PER_THREAD_GUARDED_BACKENDS, "", "KeyError"),
    ("cached_ops_elsewhere", "cached-ops", HAS_CACHED_OPS, "torch._ops.get_cached_ops (2.1+)", "Set changed size"),
    ("export_trace_elsewhere", "export-trace-state", HAS_EXPORT_TRACE, "non-strict export", ""),
    ("export_load_elsewhere", "export-deserializer", HAS_EXPORT_LOAD, "the export deserializer global (2.3+)", ""),
    (
        "export_save_elsewhere",
        "export-save",
        HAS_EXPORT_SAVE,
        "an exported program's example inputs pickled on save (2.4+)",
        "Refusing to stomp on existing FakeTensor reducer",
    ),
    (
        "pre_dispatch_elsewhere",
        "pre-dispatch-modes",
        HAS_PRE_DISPATCH_MODES,
        "a pre-dispatch mode stack and non-strict export",
        "modes on the main thread's stack: 1;",
    ),
    pytest.param(
        "make_fx_tracer_elsewhere",
        "make-fx-tracer",
        HAS_MAKE_FX_TRACER,
        "a make_fx tracer global (2.4+)",
        "Cannot reenter",
        marks=pytest.mark.skipif(
            TORCH_CRASHES_ON_CONCURRENT_MAKE_FX, reason="torch 2.10 - 2.11 segfault when threads make_fx at once"
        ),
        id="make-fx-tracer",
    ),
    ("fake_impl_ctx_elsewhere", "fake-impl-ctx", HAS_FAKE_IMPL_CTX, "torch.library.custom_op (2.4+)", "FakeImplCtx"),
    (
        "export_builtins_after_overlap",
        "export-builtins",
        HAS_EXPORT_BUILTINS,
        "non-strict export patching builtins (2.8+)",
        "partial (1 wrappers deep)",
    ),
]


@pytest.mark.parametrize(
    ("name", "fix", "has_hazard", "needs", "shows"),
    STATE_ELSEWHERE,
    ids=[getattr(row, "id", None) or row[1] for row in STATE_ELSEWHERE],  # a pytest.param row has its own id
)
def test_state_set_in_one_thread_stays_there(name, fix, has_hazard, needs, shows, disabled):
    result = scenario(f"_selftest.{name}()", disabled, fix=fix)
    if result is None:
        pytest.skip(f"the scenario needs {needs}")
    assert result["hazard"] == (disabled and has_hazard), result
    if disabled and has_hazard:
        assert shows in result["detail"], result


@pytest.mark.parametrize("action", ["eager_module", "symbolic_trace", "cond"])
def test_h4_trace_patches_act_only_in_the_tracing_thread(action, disabled):
    result = scenario(f"_selftest.h4_trace_patches_leak({action!r})", disabled, fix="trace-patch-isolation")
    if result is None:
        pytest.skip("this torch has no torch.cond")
    assert result["hazard"] == (disabled and HAS_H4), result


def test_h4_many_threads_tracing_at_once(disabled):
    result = scenario("_selftest.concurrent_tracers(threads=4, rounds=5)", disabled, fix="trace-patch-isolation")
    assert result["hazard"] == (disabled and HAS_H4), result
    if not disabled:
        assert result["detail"] == "all 20 traces correct", result


def test_h7_cudagraph_trees_in_a_new_thread(disabled):
    result = scenario("_selftest.h7_cudagraph_trees_in_new_thread()", disabled, fix="cudagraph-thread-trees")
    if result is None:
        pytest.skip("this torch has no CUDA graph trees (2.1+)")
    assert result["hazard"] == (disabled and HAS_H7_TREES), result


def test_h7_cudagraph_trees_leave_the_stash_when_their_thread_ends(disabled):
    result = scenario("_selftest.h7_cudagraph_trees_at_thread_end()", disabled, fix="cudagraph-thread-trees")
    if result is None:
        pytest.skip("this torch has no CUDA graph trees (2.1+)")
    assert result["hazard"] == (disabled and HAS_H7_TREES_AT_END), result


def test_h7_cudagraph_step_counters_stay_in_their_thread(disabled):
    result = scenario("_selftest.h7_cudagraph_step_counters()", disabled, fix="cudagraph-step-counters")
    if result is None:
        pytest.skip("this torch has no CUDA graph trees (2.1+)")
    assert result["hazard"] == (disabled and HAS_H7_COUNTERS), result
    assert result["detail"].endswith("the acting thread's: (-1, True)"), result  # its own mark-step counts


needs_recheck_fix = pytest.mark.skipif(
    not HAS_RECHECK_FIX,
    reason="compile-cache-recheck needs torch 2.6+ (below, whether threads duplicate a compile varies: "
    "2.2 does; 2.0 runs the waiting threads uncompiled, 2.3 did not either)",
)


@needs_recheck_fix
def test_threads_starting_together_compile_once(disabled):
    # 3 threads: one compiles while the other two miss the cache and wait for compile_lock.
    call = SCENARIO.format(call="_selftest.duplicate_compiles(3)")
    ran = run_python(call, disable="compile-cache-recheck" if disabled else None)
    if disabled and TORCH_CRASHES_ON_CONCURRENT_RECOMPILE and ran.returncode != 0:
        return  # the duplicate compiles crashed this torch (SIGSEGV, or a Dynamo internal error): the hazard
    assert ran.returncode == 0, ran.stderr[-2000:]
    result = ran.json()
    assert result["hazard"] == disabled, result
    if not disabled:
        assert result["detail"].startswith("1 compiles"), result


@needs_recheck_fix
@pytest.mark.skipif(
    TORCH_CRASHES_ON_CONCURRENT_RECOMPILE,
    reason="torch 2.10 - 2.11 crash (SIGSEGV), with or without torchfix, when a thread recompiles a frame "
    "that other threads are waiting to run (without torchfix, they crash on duplicate compiles of one too)",
)
@pytest.mark.parametrize("call", ["sizes=(2, 3, 2)", "backends=(0, 1, 0)"], ids=["other-input", "other-backend"])
def test_a_thread_the_first_compile_does_not_fit_compiles_its_own(call):
    # The second thread's input fails the first compile's guards, or it compiles with another backend:
    # it must compile its own (the third reuses the first).
    result = scenario(f"_selftest.duplicate_compiles(3, {call})", disabled=False)
    assert not result["hazard"] and result["detail"].startswith("2 compiles"), result


@pytest.mark.parametrize("propagate", [False, True], ids=["as-is", "propagate_config"])
def test_h6_config_set_in_main_thread_reaches_workers(propagate):
    # A thread started before the settings and one started after; each reads without setting anything.
    ran = run_ok(f"""
import json, threading
import torch, torchfix
import torch._dynamo.config as dynamo_config
name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"  # 2.7 renamed it
started, go, seen = threading.Event(), threading.Event(), {{}}
def read(key):
    seen[key] = getattr(dynamo_config, name)
def early():
    started.set(); go.wait(60); read("early")
first = threading.Thread(target=early); first.start(); started.wait(60)
setattr(dynamo_config, name, 3)
propagated = torchfix.propagate_config() if {propagate} else []
go.set(); first.join()
later = threading.Thread(target=read, args=("later",)); later.start(); later.join()
def own():  # a worker's own setting, and config.patch, stay per-thread on top
    with dynamo_config.patch(name, 5):
        seen["patched"] = getattr(dynamo_config, name)
worker = threading.Thread(target=own); worker.start(); worker.join()
read("main")
print(json.dumps({{"propagated": [p.rsplit(".", 1)[1] for p in propagated], "seen": seen}}))
""").json()
    if not HAS_H6:
        assert ran == {"propagated": [], "seen": {"early": 3, "later": 3, "patched": 5, "main": 3}}
    elif propagate:
        assert ran == {
            "propagated": ["recompile_limit"],  # torch 2.12+ names it so
            "seen": {"early": 3, "later": 3, "patched": 5, "main": 3},
        }
    else:  # the hazard: workers see the default
        assert ran["seen"]["early"] != 3 and ran["seen"]["later"] != 3 and ran["seen"]["main"] == 3, ran
