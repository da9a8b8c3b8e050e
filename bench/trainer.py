"""Trainer throughput: dflash_train with 1, 2, 3 drafter replicas on one device, three ways.

* ``threads``: the trainer as shipped, N drafter threads in one process, torchfix on;
* ``lock``: the same threads without torchfix, with the usual workaround: a lock held around each thread's
  first forward and backward (its compile), released when the thread reaches the gradient barrier (a lock
  held through the barrier would deadlock it). Installed here by wrapping two trainer methods; the trainer
  has no such lock;
* ``processes``: one process per replica (torchrun, N ranks x 1 drafter thread, each with its own target
  thread, ``--ranks-share-devices``: all on the one device, gradients all-reduced over gloo), no torchfix.

On CUDA, also with CUDA graphs (``--compile-mode reduce-overhead``: the drafter step's whole loss compiled
and replayed as CUDA graphs): ``threads+cg`` for every N, and ``processes+cg`` for 3 replicas.

Every configuration runs in fresh processes with fresh Inductor/Triton caches and the same global batch,
seed and steps; tokens/s is the trainer's own figure (context tokens after the first, compiling, step).
Also reported: time until every drafter thread finished its first step, peak memory, compiled graphs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# The lock-around-the-first-step workaround, put around the unmodified trainer.
LOCKED_MAIN = r"""
import sys, threading
from dflash_train import __main__ as cli, model, workers

first_step_lock = threading.Lock()
holding, done = set(), set()
training_loss, wait = model.Drafter.training_loss, workers.StepSync.wait

def locked_training_loss(self, *args, **kwargs):
    me = threading.get_ident()
    if me not in done and me not in holding:
        first_step_lock.acquire()
        holding.add(me)
    return training_loss(self, *args, **kwargs)

def release_at_barrier(self, *args, **kwargs):
    me = threading.get_ident()
    if me in holding:
        holding.discard(me)
        done.add(me)
        first_step_lock.release()
    return wait(self, *args, **kwargs)

model.Drafter.training_loss, workers.StepSync.wait = locked_training_loss, release_at_barrier
sys.exit(cli.main(sys.argv[1:]))
"""


def _flags(device: str, replicas_per_process: int, steps: int, batch: int, seq_len: int, quick: bool) -> list[str]:
    flags = [
        f"--target-devices={device}",
        f"--drafter-devices={device}",
        f"--drafter-threads-per-device={replicas_per_process}",
        f"--steps={steps}",
        f"--batch-size={batch}",
        f"--seq-len={seq_len}",
        "--eval-prompts=0",
        "--save-every=0",
        "--no-progress",
        "--watchdog-timeout=600",
    ]
    if quick:
        flags += ["--tiny-target-steps=0", "--backend=eager", "--drafter-layers=1", "--num-anchors=2"]
    return flags


# Row names of the --compile-mode runs; the default mode's rows keep the bare way's name.
MODE_SUFFIX = {"default": "", "reduce-overhead": "+cg"}


def one(
    mode: str,
    replicas: int,
    device: str,
    steps: int,
    batch: int,
    seq_len: int,
    quick: bool,
    compile_mode: str = "default",
    *,
    disable: str = "",
    extra: tuple[str, ...] = (),
    compile_caches: Path | None = None,
) -> dict:
    """One run of the trainer. ``disable``: TORCHFIX_DISABLE for a ``threads`` run; ``extra``: more trainer
    flags (a later flag wins); ``compile_caches``: Inductor/Triton caches to share with other runs (default:
    fresh ones)."""
    label = mode + MODE_SUFFIX[compile_mode]
    out = Path(tempfile.mkdtemp(prefix=f"bench-{label}{replicas}-"))
    caches = compile_caches or out
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFIX_")}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"), TRITON_CACHE_DIR=str(caches / "triton"))
    flags = [*_flags(device, 1 if mode == "processes" else replicas, steps, batch, seq_len, quick), f"--out-dir={out}"]
    flags += extra
    if disable:
        env["TORCHFIX_DISABLE"] = disable
    if compile_mode != "default":
        flags.append(f"--compile-mode={compile_mode}")
    if quick:
        flags.append(f"--cache-dir={out / 'cache'}")
    if mode == "threads":
        command = [sys.executable, "-m", "dflash_train", *flags]
    elif mode == "lock":
        env["TORCHFIX_DISABLE"] = "1"
        command = [sys.executable, "-c", LOCKED_MAIN, *flags]
    else:
        env["TORCHFIX_DISABLE"] = "1"
        command = [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={replicas}"),
            *("-m", "dflash_train", *flags, "--ranks-share-devices"),
        ]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    row: dict[str, object] = {"mode": label, "replicas": replicas, "compile_mode": compile_mode}
    metrics = out / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if proc.returncode == 0 else []
    summary = next((r for r in records if r["type"] == "summary"), None)
    if summary is None:
        return row | {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1], "returncode": proc.returncode}
    memory = [r for r in records if r["type"] == "memory"]
    cuda_peak = sum(v for r in memory for k, v in r.items() if k.startswith("cuda"))
    dynamo = [r for r in records if r["type"] == "dynamo"]
    return row | {
        "tokens_per_s": summary["tokens_per_s"],
        "all_first_steps_s": max(r["seconds"] for r in records if r["type"] == "first_step"),
        "cuda_peak_gib": round(cuda_peak, 3),
        "host_rss_gib": round(sum(r.get("host_rss", 0.0) for r in memory), 3),
        "unique_graphs": sum(r["unique_graphs"] for r in dynamo),
        "eager_fallback": any(r["eager_fallback"] for r in dynamo),
        # Graphs inductor compiled without the CUDA graphs asked for (the trainer logs why).
        "cudagraph_skips": sum(r.get("cudagraph_skips", 0) for r in dynamo),
    }


def configurations(device: str, counts: tuple[int, ...]) -> list[tuple[str, int, str]]:
    """The rows to run, as (way, replicas, --compile-mode): threads for every count, lock and processes from
    2 replicas; on CUDA, threads with CUDA graphs for every count and processes with them for 3."""
    cuda = device.startswith("cuda")
    runs = []
    for n in counts:
        runs += [("threads", n, "default")] + ([("threads", n, "reduce-overhead")] if cuda else [])
        runs += [("lock", n, "default"), ("processes", n, "default")] if n > 1 else []
        runs += [("processes", n, "reduce-overhead")] if cuda and n == 3 else []
    return runs


def run(quick: bool = False, device: str = "cpu") -> dict[str, object]:
    import torch

    if quick:
        counts, steps, batch, seq_len = (1, 2), 4, 2, 64
    elif device.startswith("cuda"):
        counts, steps, batch, seq_len = (1, 2, 3), 120, 12, 256
    else:
        counts, steps, batch, seq_len = (1, 2, 3), 30, 6, 128
    rows = [
        one(mode, replicas, device, steps, batch, seq_len, quick, compile_mode)
        for mode, replicas, compile_mode in configurations(device, counts)
    ]
    threads = {r["replicas"]: r.get("tokens_per_s") for r in rows if r["mode"] == "threads"}
    for row in rows:
        base = threads.get(row["replicas"])
        if base and row.get("tokens_per_s"):
            row["vs_threads"] = round(row["tokens_per_s"] / base, 3)
    return {
        "torch": str(torch.__version__),
        "device": device,
        "steps": steps,
        "global_batch": batch,
        "seq_len": seq_len,
        "rows": rows,
    }


def table(result: dict) -> str:
    lines = [
        f"torch {result['torch']}, {result['device']}, {result['steps']} steps, global batch "
        f"{result['global_batch']} x {result['seq_len']} tokens"
    ]
    if any(row.get("compile_mode") == "reduce-overhead" for row in result["rows"]):
        lines.append("+cg: --compile-mode reduce-overhead (the drafter step's loss as CUDA graphs)")
    for row in result["rows"]:
        label = f"{row['mode']:<12} x{row['replicas']}"
        if "error" in row:
            lines.append(f"{label}: failed (exit {row['returncode']}): {row['error']}")
            continue
        skips = row.get("cudagraph_skips", 0)
        lines.append(
            f"{label}: {row['tokens_per_s'] or 0:>9,.0f} tokens/s (x{row.get('vs_threads', 1.0):.2f} threads), "
            f"all first steps {row['all_first_steps_s']:.1f} s, peak CUDA {row['cuda_peak_gib']:.2f} GiB, "
            f"host RSS {row['host_rss_gib']:.2f} GiB, {row['unique_graphs']} graphs"
            f"{', EAGER FALLBACK' if row['eager_fallback'] else ''}"
            f"{f', CUDA GRAPHS SKIPPED {skips} TIMES' if skips else ''}"
        )
    return "\n".join(lines)
