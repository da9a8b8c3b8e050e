"""Import orderings and the install/uninstall lifecycle, each in a fresh interpreter."""

import pytest
from conftest import HAS_H1, HAS_H3, HAS_H4, SCENARIOS, hazard_here, needs_fix, run_ok, run_scenario

needs_h1 = pytest.mark.skipif(not HAS_H1, reason="torch 2.14+ keeps the FX flag per thread itself")

# Prints the fix's state and whether H1 shows, as JSON on the last line.
REPORT = """
import json
import torchfix
from torchfix.fixes.fx_tracing_flag import h1_nested_trace_error
print(json.dumps({"state": {s.name: s.state.value for s in torchfix.status()}["fx-tracing-flag"],
                  "hazard": h1_nested_trace_error(**H1_KWARGS).hazard}))
"""


def report(prelude: str, h1_kwargs: str = "{}", **kwargs) -> dict:
    return run_ok(prelude + f"\nH1_KWARGS = {h1_kwargs}\n" + REPORT, **kwargs).json()


def expected_state() -> str:
    return "applied" if HAS_H1 else "not needed"


def test_import_torchfix_before_torch():
    assert report("import torchfix\nimport torch") == {"state": expected_state(), "hazard": False}


def test_import_torchfix_after_torch():
    assert report("import torch\nimport torchfix", forked="torch") == {"state": expected_state(), "hazard": False}


def test_import_torchfix_before_a_torch_submodule():
    # The hook is on the package: `import torch.fx` imports torch first, then fires it.
    assert report("import torchfix\nimport torch.fx") == {"state": expected_state(), "hazard": False}


def test_function_compiled_before_import_torchfix_is_fixed_too():
    # Dynamo captured its predicate when this function was wrapped (torch 2.3+); the code swap reaches it.
    prelude = """
import torch
early = torch.compile(lambda x: x * 2, backend="eager")
early(torch.ones(2))
import torchfix
"""
    found = report(prelude, h1_kwargs="{'compiled': early}", forked="torch")
    assert found == {"state": expected_state(), "hazard": False}


@needs_h1
def test_uninstall_restores_torch_and_brings_the_hazard_back():
    ran = run_ok(
        """
import json, types
import torch
import torch.fx._symbolic_trace as st
import torch.utils.checkpoint as cp
import inspect
recompute = getattr(cp, "_checkpoint_without_reentrant_generator", None) or cp._checkpoint_without_reentrant
functions = [st.Tracer.trace, st.is_fx_tracing, inspect.unwrap(recompute)]
def codes():
    return {f.__qualname__: f.__code__ for f in functions}
before = codes()
import torchfix
from torchfix.fixes.fx_tracing_flag import h1_nested_trace_error
def state(statuses):
    return {s.name: s.state.value for s in statuses}["fx-tracing-flag"]
patched = {name for name, code in codes().items() if code is not before[name]}
torchfix.uninstall()
restored = all(code is before[name] for name, code in codes().items())
print(json.dumps({
    "patched": sorted(patched),
    "restored": restored,
    "plain_module": type(st) is types.ModuleType and "_is_fx_tracing_flag" in vars(st)
        and "_is_fx_tracing_tls" not in vars(st),
    "state": state(torchfix.status()),
    "hazard_after_uninstall": h1_nested_trace_error().hazard,
    "reinstall": state(torchfix.install()),
    "hazard_after_reinstall": h1_nested_trace_error().hazard,
}))
""",
        forked="torch",
    ).json()
    assert len(ran["patched"]) == 3, ran["patched"]
    assert ran["restored"] and ran["plain_module"]
    assert ran["state"] == "not installed"
    assert ran["hazard_after_uninstall"] is True
    assert ran["reinstall"] == "applied" and ran["hazard_after_reinstall"] is False


def test_double_install_changes_nothing():
    ran = run_ok(
        """
import json
import torch, torchfix
import torch.fx._symbolic_trace as st
code, cls = st.Tracer.trace.__code__, type(st)
again = {s.name: s.state.value for s in torchfix.install()}
print(json.dumps({"same": st.Tracer.trace.__code__ is code and type(st) is cls,
                  "state": again["fx-tracing-flag"]}))
""",
        forked="torch",
    ).json()
    assert ran == {"same": True, "state": expected_state()}


@needs_h1
def test_uninstall_before_torch_is_imported_cancels_the_hook():
    ran = run_ok("""
import json
import torchfix
def state():
    return {s.name: s.state.value for s in torchfix.status()}["fx-tracing-flag"]
pending = state()
torchfix.uninstall()
import torch
import torch.fx._symbolic_trace as st
print(json.dumps({"pending": pending, "state": state(),
                  "untouched": "_is_fx_tracing_flag" in vars(st)}))
""").json()
    assert ran == {"pending": "pending import", "state": "not installed", "untouched": True}


@pytest.mark.skipif(not (HAS_H3 and HAS_H4), reason="needs a torch with both H3 and H4")
def test_uninstall_restores_compiler_flags_and_trace_patches():
    ran = run_ok(
        """
import inspect, json
import torch, torch.compiler, torch.fx._symbolic_trace as st
def codes(module):  # no torchfix import yet: that would install it
    found = {}
    for key, value in vars(module).items():
        members = vars(value).items() if isinstance(value, type) and value.__module__ == module.__name__ else []
        for name, obj in [(key, value), *((f"{key}.{k}", v) for k, v in members)]:
            code = getattr(inspect.unwrap(obj) if inspect.isfunction(obj) else obj, "__code__", None)
            if code is not None:
                found[name] = code
    return found
def snapshot():
    return [(type(m), sorted(vars(m)), codes(m)) for m in (torch.compiler, st)]
before = snapshot()
import torchfix
from torchfix.fixes.compiler_flags import h3_is_compiling_elsewhere
from torchfix.fixes.trace_patch_isolation import h4_trace_patches_leak
states = {s.name: s.state.value for s in torchfix.status()}
fixed = [h3_is_compiling_elsewhere().hazard, h4_trace_patches_leak("eager_module").hazard]
torchfix.uninstall()
after_uninstall = [h3_is_compiling_elsewhere().hazard, h4_trace_patches_leak("eager_module").hazard]
print(json.dumps({"states": [states["compiler-flags"], states["trace-patch-isolation"]], "fixed": fixed,
                  "restored": snapshot() == before, "after_uninstall": after_uninstall}))
""",
        forked="torch",
    ).json()
    assert ran == {
        "states": ["applied", "applied"],
        "fixed": [False, False],
        "restored": True,
        "after_uninstall": [True, True],
    }


def test_a_waiting_fix_module_loads_with_its_trigger():
    # `import torchfix` imports only the fix modules it applies; one that waits for Dynamo loads with Dynamo's module,
    # which keeps its own loader (the post-import hook's wrapper is not left on it).
    ran = run_ok(
        """
import json, sys
import torch, torchfix
waiting = [e for e in torchfix.fixes.ROSTER if e.trigger not in sys.modules]
seen = {"loaded_early": [e.module for e in waiting if e.module in sys.modules]}
import torch._dynamo.eval_frame as ef
seen["loaded_with_it"] = [e.module in sys.modules for e in waiting if e.trigger == ef.__name__]
seen["loader"] = [type(ef.__loader__).__name__, ef.__spec__.loader is ef.__loader__]
print(json.dumps(seen))
""",
        forked="torch",
    ).json()
    assert ran["loaded_early"] == [] and all(ran["loaded_with_it"]), ran
    assert ran["loader"] == ["SourceFileLoader", True], ran


# compile-cache-recheck patches Dynamo, which `import torch` does not load: it waits for that import.
RECHECK_LIFECYCLE = """
import json, sys
{prelude}
import torchfix
def state():
    return {{s.name: s.state.value for s in torchfix.status()}}["compile-cache-recheck"]
# Some releases load Dynamo while the other fixes apply (then this one applies at once too).
seen = {{"at_import": state(), "dynamo_at_import": "torch._dynamo.convert_frame" in sys.modules}}
{steps}
import torch._dynamo.convert_frame as cf
seen["after_dynamo"] = state()
seen["helper"] = "_compile_unless_cached" in vars(cf)
print(json.dumps(seen))
"""


@needs_fix("compile-cache-recheck")
@pytest.mark.parametrize(
    "prelude, steps, expected",
    [
        ("import torch", "", {"at_import": "pending import", "after_dynamo": "applied", "helper": True}),
        ("import torch._dynamo", "", {"at_import": "applied", "after_dynamo": "applied", "helper": True}),
        ("", "torchfix.uninstall()", {"at_import": "pending import", "after_dynamo": "not installed", "helper": False}),
        (
            "",
            "torchfix.uninstall(); torchfix.install()",
            {"at_import": "pending import", "after_dynamo": "applied", "helper": True},
        ),
    ],
    ids=["dynamo-later", "dynamo-first", "uninstalled-before-dynamo", "reinstalled-before-dynamo"],
)
def test_fix_that_waits_for_dynamo(prelude, steps, expected):
    # Without a prelude torchfix comes before torch: a fresh interpreter. With one, forked from torch alone (Dynamo
    # not imported yet).
    seen = run_ok(RECHECK_LIFECYCLE.format(prelude=prelude, steps=steps), forked="torch" if prelude else None).json()
    if seen.pop("dynamo_at_import"):
        expected["at_import"] = "applied"
    assert seen == expected


@needs_fix("compile-cache-recheck")
def test_uninstall_restores_dynamo_callback():
    ran = run_ok(
        """
import json
import torch._dynamo.convert_frame as cf
original = cf.CatchErrorsWrapper.__call__.__code__
import torchfix
patched = cf.CatchErrorsWrapper.__call__.__code__ is not original
torchfix.uninstall()
print(json.dumps({"patched": patched, "restored": cf.CatchErrorsWrapper.__call__.__code__ is original,
                  "helper": "_compile_unless_cached" in vars(cf)}))
""",
        forked="torch",
    ).json()
    assert ran == {"patched": True, "restored": True, "helper": False}


@pytest.mark.skipif(
    not hazard_here("compiled_autograd_region_elsewhere"), reason="in_compiled_autograd_region exists from torch 2.5"
)
def test_compiled_autograd_graphs_cached_before_install_or_uninstall_still_run():
    # Compiled autograd keeps each graph's runtime_wrapper, a closure made by the patched file, in its C++ cache;
    # compiled-autograd-region empties that cache when it applies and reverts. Without that, a graph cached before
    # `import torchfix` writes the global back into the module's dict while it runs (with torchfix the name is out of
    # the dict while a thread holds a value of its own: inside a graph), and one cached with it raises NameError (the
    # holder is gone) after uninstall.
    ran = run_ok(
        """
import json
import torch
import torch._dynamo.compiled_autograd as ca
enable = getattr(ca, "_enable", None) or ca.enable  # enable: 2.5
seen = []
def compiler(gm):
    def run(*args):
        seen.append([ca.in_compiled_autograd_region, "in_compiled_autograd_region" in vars(ca)])
        return gm(*args)
    return run
def step():
    w = torch.ones(2, requires_grad=True)
    with enable(compiler):
        (w * 2).sum().backward()
    return w.grad.tolist()
found = {"before": step()}
import torchfix
found["installed"] = step()
torchfix.uninstall()
found["uninstalled"] = step()
found["seen inside the graphs"] = seen
print(json.dumps(found))
""",
        forked="torch",
    ).json()
    assert ran == {
        "before": [2.0, 2.0],
        "installed": [2.0, 2.0],
        "uninstalled": [2.0, 2.0],
        # (the flag, whether the module's dict holds it) inside each graph: before, with torchfix, after
        "seen inside the graphs": [[True, True], [True, False], [True, True]],
    }


# Per fix, its first scenario that shows a hazard on this torch and leaves the process usable without the fix.
SHOWN_HERE = list(
    {
        s["fix"]: s
        for s in reversed(SCENARIOS)
        if s["hazard"] and s["stage"] == 0 and not s["crashes"] and s["runs_without_fix"]
    }.values()
)[::-1]

UNINSTALL_ONE = """
import dataclasses, importlib, json, os
import torch, torchfix
from torchfix import fixes
def load_triggers():  # the fixes that wait for a part of torch apply when it is imported
    for fix in fixes.ALL:
        try:
            importlib.import_module(fix.trigger)
        except ImportError:
            pass
def hazard():
    result = {call}
    if result is None:  # what the scenario needs is not here (a CUDA device)
        print("null", flush=True)
        os._exit(0)
    return result.hazard
load_triggers()
found = {{"with": hazard()}}
torchfix.uninstall()
found["after uninstall"] = hazard()
torchfix.install()
load_triggers()
found["after reinstall"] = hazard()
found["state"] = next(s.state.value for s in torchfix.status() if s.name == {fix!r})
print(json.dumps(found), flush=True)
os._exit(0)  # torch 2.3's interpreter teardown after a threaded compile can abort or hang, fix or not
"""


@pytest.mark.parametrize("declared", SHOWN_HERE, ids=[s["fix"] for s in SHOWN_HERE])
def test_uninstall_brings_each_hazard_back_and_install_removes_it_again(declared):
    found = run_scenario(UNINSTALL_ONE.format(call=declared["call"], fix=declared["fix"]))
    if found is None:
        pytest.skip(f"the scenario needs {declared['needs']}")
    assert found == {"with": False, "after uninstall": True, "after reinstall": False, "state": "applied"}, found
