"""H1 and H5 on a real GPU: threads training compiled flex-attention blocks on one device, cold caches.

Needs CUDA (run on the GPU machine: ``pytest -m cuda``); skipped elsewhere.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
SCRIPT = Path(__file__).with_name("cuda_threaded_training.py")


def train_in_threads(no_torchfix: bool, timeout: float = 150.0) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(), TRITON_CACHE_DIR=tempfile.mkdtemp())
    command = [sys.executable, str(SCRIPT), "--timeout", str(timeout)] + (["--no-torchfix"] if no_torchfix else [])
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout + 120)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_threads_training_compiled_flex_attention_on_one_gpu(disabled):
    report = train_in_threads(no_torchfix=disabled)
    if disabled:
        assert report["hung"] or report["errors"], report  # H5 (hang) or H1 (nested-trace error)
    else:
        assert not report["hung"] and not report["errors"], report
        assert len(report["first_step_s"]) == report["threads"]


def trainer_losses(streams: str, compile_mode: str, out: Path) -> subprocess.Popen:
    """Start the trainer on cuda:0 (random tiny target, 1 target + 2 drafter threads, fresh compile caches)."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(out / "inductor"), TRITON_CACHE_DIR=str(out / "triton"))
    flags = ["--target-devices=cuda:0", "--drafter-devices=cuda:0", "--drafter-threads-per-device=2", "--steps=30"]
    flags += ["--tiny-target-steps=0", "--regenerate=0", "--eval-prompts=0", "--save-every=0", "--no-progress"]
    flags += [f"--cuda-streams={streams}", f"--compile-mode={compile_mode}", f"--out-dir={out}"]
    flags += [f"--cache-dir={out / 'cache'}"]
    command = [sys.executable, "-m", "dflash_train", *flags]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("compile_mode", ["default", "reduce-overhead"])
def test_a_stream_per_thread_trains_as_one_shared_stream_does(tmp_path, compile_mode):
    """The same seeded job, twice on one shared stream and once with a stream per thread (the three at once, so
    that the GPU is busy): the per-thread run's losses differ from a shared run's by no more than the two shared
    runs differ from each other. A tensor read before the stream that made it finished, or overwritten after
    its memory went back to the allocator, would show as a different loss."""
    streams = {"shared-a": "shared", "shared-b": "shared", "per-thread": "per-thread"}
    runs = {name: trainer_losses(how, compile_mode, tmp_path / name) for name, how in streams.items()}
    losses = {}
    for name, proc in runs.items():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in records if r["type"] == "train"]
    assert len(losses["per-thread"]) == len(losses["shared-a"]) == 30
    spread = max(abs(a - b) for a, b in zip(losses["shared-a"], losses["shared-b"]))
    diff = max(abs(a - b) for a, b in zip(losses["per-thread"], losses["shared-a"]))
    assert diff <= spread + 1e-6 * max(losses["shared-a"]), (diff, spread, losses)


# One thread traces a joint graph with make_fx: on CUDA its backward runs on autograd's device thread, which must
# see the tracing thread's make_fx tracer and node metadata (both per thread with torchfix), as it sees torch's
# globals without it.
DEVICE_THREAD_TRACE = r"""
import json, threading
import torch
import torchfix
from torch.fx.experimental import proxy_tensor

seen = []

class Probe(torch.autograd.Function):
    forward = staticmethod(lambda ctx, x: x * 2)

    @staticmethod
    def backward(ctx, g):
        tracer = proxy_tensor._CURRENT_MAKE_FX_TRACER
        seen.append({"other_thread": threading.get_ident() != main, "tracer": tracer is not None})
        return torch.cond(g.sum() > 0, lambda g: g * 2, lambda g: g * 3, (g,))

def joint(x):
    return torch.autograd.grad(Probe.apply(x).sin().sum(), x)

main = threading.get_ident()
x = torch.randn(8, device="cuda", requires_grad=True)
with torch.fx.traceback.preserve_node_meta():
    graph = proxy_tensor.make_fx(joint, tracing_mode="fake")(x)
nodes = [n for n in graph.graph.nodes if n.op == "call_function"]
print(json.dumps({"seen": seen, "nodes": len(nodes), "with_seq_nr": sum("seq_nr" in n.meta for n in nodes)}))
"""


@pytest.mark.skipif(
    not hasattr(torch._C, "_remove_obj_from_tls"),
    reason="per-thread state is in torch's stash from 2.13 only (torchfix/_thread_stash.py: ThreadSpaces)",
)
def test_a_backward_traced_on_the_device_thread_sees_the_tracing_threads_state():
    runs = {}
    for label, disabled in (("with", ""), ("without", "1")):
        env = dict(os.environ, TORCHFIX_DISABLE=disabled)
        proc = subprocess.run([sys.executable, "-c", DEVICE_THREAD_TRACE], capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[label] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert runs["with"]["seen"] == [{"other_thread": True, "tracer": True}], runs  # the device thread, traced
    assert runs["with"] == runs["without"], runs


FAILED_CAPTURE = """
import threading, torch, torchfix
g = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(g):
        torch.ones(1, device="cuda") * 2
        torch.cuda.synchronize()  # refused inside a capture: the capture fails
except Exception as exc:
    print("the capture failed:", type(exc).__name__)
done = []
other = threading.Thread(target=lambda: done.append(torch.cuda.graph(torch.cuda.CUDAGraph()).__enter__()), daemon=True)
other.start()
other.join(60)
print("another thread captured" if done or not other.is_alive() else "another thread waits", flush=True)
import os; os._exit(0)
"""


def test_a_failed_capture_leaves_captures_to_other_threads():
    """cuda-graph-capture's lock over captures goes back when a capture fails in ``__exit__``."""
    proc = subprocess.run([sys.executable, "-c", FAILED_CAPTURE], capture_output=True, text=True, timeout=180)
    assert "the capture failed" in proc.stdout and "another thread captured" in proc.stdout, proc.stderr[-3000:]
