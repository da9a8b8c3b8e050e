"""The watcher (``torchfix.watch``, ``python -m torchfix watch``): what one thread changes where another thread can
see it, found by looking from another thread. Samples are taken by hand here, while events hold the threads inside
their work, so nothing depends on timing."""

import pytest
from conftest import HAS_H1, HAS_H4, TORCH_VERSION, run_ok, torchfix_cli

from torchfix import fixes
from torchfix.doctor.watch import DECLARED, Watcher

WATCHED = """
import json, threading
import torchfix, torch
from torchfix.doctor.watch import Watcher

inside_trace, inside_sdpa, done = threading.Event(), threading.Event(), threading.Event()

def traced(x):  # an FX trace held open: the FX flag is the tracing thread's, or (H1) the process's
    inside_trace.set(); done.wait(60)
    return x * 2

attention = getattr(getattr(torch.nn, "attention", None), "sdpa_kernel", None)  # torch 2.3+
def math_only():  # a C++ process switch set from Python: every thread's SDPA backends
    with attention(torch.nn.attention.SDPBackend.MATH):
        inside_sdpa.set(); done.wait(60)

watcher = Watcher().start(background=False)
threads = [threading.Thread(target=torch.fx.symbolic_trace, args=(traced,))]
threads += [threading.Thread(target=math_only)] if attention else []
for thread in threads:
    thread.start()
inside_trace.wait(60); inside_sdpa.wait(60) if attention else None
watcher.sample()
done.set()
for thread in threads:
    thread.join(60)
watcher.stop()
print(json.dumps({c["name"]: c["restored"] for c in watcher.report()["changes"]}))
"""
FLAG, FLASH = "torch.fx._symbolic_trace._is_fx_tracing_flag", "torch._C._get_flash_sdp_enabled()"
CALL = "torch.nn.modules.module.Module.__call__"  # the tracer's patch: a per-thread dispatcher there with torchfix


def test_the_watcher_reports_shared_state_and_not_per_thread_state():
    with_fix, without = run_ok(WATCHED, forked="torch").json(), run_ok(WATCHED, disable="1", forked="torch").json()
    assert FLAG not in with_fix and CALL not in with_fix, with_fix  # per thread with torchfix (the flag upstream 2.14+)
    if HAS_H1:
        assert without.get(FLAG) is True, without  # set while the trace ran, then restored
    if HAS_H4:
        assert without.get(CALL) is True, without
    if FLASH in without:  # torch 2.3+: C++ switches are the process's, fix or not
        assert with_fix.get(FLASH) is True and without[FLASH] is True


def test_watch_runs_a_program_and_prints_what_changed(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import torch\ntorch.fx.symbolic_trace(lambda x: x + 1)\nprint('job ran')\n")
    report = tmp_path / "report.json"
    ran = torchfix_cli("watch", "--json", str(report), "--", str(script), forked="torch")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "job ran" in ran.stdout and "torchfix watch:" in ran.stderr and report.exists()


REINSTALLED = """
import json, torchfix, torch, torch._dynamo, torch.export
from torchfix.doctor.watch import Watcher
torchfix.uninstall()  # torch's globals back in its modules, where the watcher finds them before a fix moves them
watcher = Watcher().start(background=False)
torchfix.install()  # the fixes move them to per-thread storage (and serve module.NAME) while it watches
watcher.stop()
print(json.dumps([c["name"] for c in watcher.report()["changes"]]))
"""


def test_a_global_a_fix_moves_while_watched_is_read_as_other_modules_read_it():
    """A fix applied while the watcher runs (one waiting for a module's import) takes the global out of the
    module's dict: the watcher reads ``module.NAME`` then, the watcher thread's own value, and reports nothing."""
    assert run_ok(REINSTALLED, forked="torch").json() == []


def test_the_declared_names_are_triaged_with_a_reason_and_real_fixes():
    names = {fix.name for fix in fixes.ALL}
    for declared in DECLARED:
        assert declared.verdict in ("benign", "known") and declared.reason, declared
        assert not declared.fix or (declared.verdict == "known" and declared.fix in names), declared
        if declared.verdict == "known":  # a known name is watched: neither a benign pattern nor a counter hides it
            assert not Watcher()._skip(declared.pattern.replace("*", "x")), declared


FAMILIES = """
import json, threading
import torchfix, torch
import torch._dynamo  # the mode stack manager is watched from the start
from torch.utils._python_dispatch import TorchDispatchMode
from torchfix.doctor.watch import Watcher

held, release = [], threading.Event()

def holding(work):  # work(hold) in a thread of its own, which stays in hold() where its family's state is set
    inside = threading.Event()
    held.append(inside)
    def hold():
        inside.set(); release.wait(120)
    thread = threading.Thread(target=work, args=(hold,)); thread.start()
    return thread

class Sin(torch.nn.Module):
    def forward(self, x):
        return x.sin() + 1
program = torch.export.export(Sin(), (torch.ones(2),))

def decompositions(hold):  # 1 and 2: run_decompositions' kernel overrides, the export's backend switches
    table = torch.export.default_decompositions()
    table[torch.ops.aten.sin.default] = lambda *args, **kwargs: hold() or NotImplemented
    program.run_decompositions(table)

class Modes(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

def compile_in_mode(hold):  # 3: a compile's trace sets its thread's torch-function modes aside
    def backend(gm, example_inputs):
        hold()
        return gm.forward
    with Modes():
        torch.compile(lambda x: x.cos() + 1, backend=backend)(torch.ones(2))

def sdpa(hold):  # 4: sdpa_kernel's backend switches
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        hold()

class Dispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

def dispatch_mode(hold):  # 5: the dispatch-mode flags
    with Dispatch():
        hold()

watcher = Watcher().start(background=False)
# One at a time, the compile first: without the fixes, another family's state already set can keep a compile from
# reaching its backend (torch 2.10).
threads = []
for work in (compile_in_mode, decompositions, sdpa, dispatch_mode):
    threads.append(holding(work))
    assert held[-1].wait(120), work.__name__
watcher.sample()
release.set()
for thread in threads:
    thread.join(120)
watcher.stop()
print(json.dumps({c["name"]: c["known"] for c in watcher.report()["changes"]}))
"""
FAMILY_FIXES = (
    "export-decomp-kernels,export-backend-switches,function-mode-stack,sdpa-kernel-switches,dispatch-mode-flags"
)


@pytest.mark.slow
@pytest.mark.skipif(TORCH_VERSION.release < (2, 9), reason="the five families' fixes cover 2.9+ together")
def test_the_watcher_reports_the_five_families_without_their_fixes_and_nothing_new_with_them():
    """Issue 27's five families, each held open in a thread of its own: new without their fixes; with them, the
    C++ switches (out of reach) are known and nothing is new."""
    without = run_ok(FAMILIES, disable=FAMILY_FIXES, forked="torch").json()
    with_fix = run_ok(FAMILIES, forked="torch").json()
    new = {name for name, known in without.items() if known is None}
    assert any(name.startswith("aten.") for name in new), without  # 1: run_decompositions' overrides
    assert "torch._C._get_mkldnn_enabled()" in new, without  # 2
    assert "torch._dynamo.variables.torch_function.torch_function_mode_stack_state_mgr.stack" in new, without  # 3
    assert FLASH in new, without  # 4
    assert "torch.utils._python_dispatch._is_in_torch_dispatch_mode" in new, without  # 5
    assert {name for name, known in with_fix.items() if known is None} == set(), with_fix
