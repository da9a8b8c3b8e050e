"""The watcher (``torchfix.watch``, ``python -m torchfix watch``): what one thread changes where another thread can
see it, found by looking from another thread. Samples are taken by hand here, while events hold the threads inside
their work, so nothing depends on timing."""

from conftest import HAS_H1, run_ok, run_python

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


def test_the_watcher_reports_shared_state_and_not_per_thread_state():
    with_fix, without = run_ok(WATCHED).json(), run_ok(WATCHED, disable="1").json()
    assert FLAG not in with_fix, with_fix  # per thread with torchfix (and upstream from 2.14)
    if HAS_H1:
        assert without.get(FLAG) is True, without  # set while the trace ran, then restored
    if FLASH in without:  # torch 2.3+: C++ switches are the process's, fix or not
        assert with_fix.get(FLASH) is True and without[FLASH] is True


def test_watch_runs_a_program_and_prints_what_changed(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import torch\ntorch.fx.symbolic_trace(lambda x: x + 1)\nprint('job ran')\n")
    report = tmp_path / "report.json"
    ran = run_python(
        "import sys, torchfix.__main__ as m; sys.exit(m.main(sys.argv[1:]))",
        args=("watch", "--json", str(report), "--", str(script)),
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "job ran" in ran.stdout and "torchfix watch:" in ran.stderr and report.exists()
