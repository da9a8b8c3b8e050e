"""The hazards, forced with events: every scenario a fix declares (``Fix.scenarios``), each with torchfix and
with its fix disabled (TORCHFIX_DISABLE), and the checks that need more than a scenario's yes or no.

Without its fix the hazard must show on every torch its declaration names (a test that passes either way
proves nothing); with torchfix it must be gone.
"""

import pytest
from conftest import (
    HAS_H1,
    HAS_H3,
    HAS_H6,
    SCENARIOS,
    TORCH_CRASHES_ON_CONCURRENT_RECOMPILE,
    hazard_here,
    needs_fix,
    run_ok,
    run_scenario,
)

SCENARIO = """
import dataclasses, json, os, sys
import torchfix, torch
result = {call}
print(json.dumps(dataclasses.asdict(result) if result else None), flush=True)
os._exit(0)  # torch 2.3's interpreter teardown after a threaded compile can abort or hang, fix or not
"""


def scenario(call: str, disabled: bool, fix: str = "1") -> dict:
    """Run a self-test scenario (``call``: its call as source, after ``import torchfix``); ``disabled`` turns off
    ``fix`` (all fixes by default)."""
    return run_scenario(SCENARIO.format(call=call), disable=fix if disabled else None)


@pytest.mark.parametrize("declared", SCENARIOS, ids=[s["id"] for s in SCENARIOS])
def test_a_fix_removes_the_hazard_its_scenario_shows(declared, disabled):
    if declared["crashes"]:
        pytest.skip(f"torch itself can crash in {declared['call']} on this release (C++ state), fix or not")
    if not declared["runs_without_fix"]:
        pytest.skip(f"{declared['call']} runs only where {declared['fix']} applies")
    result = scenario(declared["call"], disabled, fix=declared["fix"])
    if result is None:
        pytest.skip(f"the scenario needs {declared['needs'] or 'what this torch lacks'}")
    assert result["hazard"] == (disabled and declared["hazard"]), result
    if disabled and declared["hazard"]:
        assert declared["shows"] in result["detail"], result


def test_many_threads_calling_while_another_traces(disabled):
    result = scenario(
        "torchfix.fixes.fx_tracing_flag.many_threads(rounds=12, callers=6)", disabled, fix="fx-tracing-flag"
    )
    assert result["hazard"] == (disabled and HAS_H1), result
    if disabled and HAS_H1:
        assert result["detail"].startswith("72 of 72"), result  # every call landed inside a trace


def test_h3_the_compiling_thread_itself_still_sees_is_compiling():
    result = scenario("torchfix.fixes.compiler_flags.h3_is_compiling_elsewhere()", disabled=False)
    if result is None:
        pytest.skip("this torch has no torch.compiler.is_compiling (H3 needs torch 2.3+)")
    if HAS_H3:  # the compiling thread itself still sees True, fix or not
        assert result["detail"].endswith("(in the compiling thread: True)"), result


def test_h4_many_threads_tracing_at_once(disabled):
    result = scenario(
        "torchfix.fixes.trace_patch_isolation.concurrent_tracers(threads=4, rounds=5)",
        disabled,
        fix="trace-patch-isolation",
    )
    assert result["hazard"] == (disabled and hazard_here("h4_trace_patches_leak")), result
    if not disabled:
        assert result["detail"] == "all 20 traces correct", result


def test_h7_cudagraph_step_counters_are_the_acting_threads_own():
    result = scenario("torchfix.fixes.cudagraph_step_counters.h7_cudagraph_step_counters()", disabled=False)
    if result is None:
        pytest.skip("this torch has no CUDA graph trees (2.1+)")
    assert result["detail"].endswith("the acting thread's: (-1, True)"), result  # its own mark-step counts


# Below its releases, whether threads duplicate a compile varies: 2.2 does; 2.0 runs the waiting threads
# uncompiled, 2.3 did not either.
needs_recheck_fix = needs_fix("compile-cache-recheck")


@needs_recheck_fix
def test_threads_starting_together_compile_once():
    # 3 threads: one compiles while the other two miss the cache and wait for compile_lock.
    result = scenario("torchfix.fixes.compile_cache_recheck.duplicate_compiles(3)", disabled=False)
    assert not result["hazard"] and result["detail"].startswith("1 compiles"), result


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
    result = scenario(f"torchfix.fixes.compile_cache_recheck.duplicate_compiles(3, {call})", disabled=False)
    assert not result["hazard"] and result["detail"].startswith("2 compiles"), result


@pytest.mark.parametrize("propagate", [False, True], ids=["as-is", "propagate_config"])
def test_h6_config_set_in_main_thread_reaches_workers(propagate):
    # A thread started before the settings and one started after; each reads without setting anything.
    ran = run_ok(
        f"""
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
""",
        forked="torch",
    ).json()
    if not HAS_H6:
        assert ran == {"propagated": [], "seen": {"early": 3, "later": 3, "patched": 5, "main": 3}}
    elif propagate:
        assert ran == {
            "propagated": ["recompile_limit"],  # torch 2.12+ names it so
            "seen": {"early": 3, "later": 3, "patched": 5, "main": 3},
        }
    else:  # the hazard: workers see the default
        assert ran["seen"]["early"] != 3 and ran["seen"]["later"] != 3 and ran["seen"]["main"] == 3, ran
