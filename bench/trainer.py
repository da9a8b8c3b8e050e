"""Trainer throughput: dflash_train with 1, 2, 3 drafter replicas on one device, three ways.

* ``threads``: the trainer as shipped, N drafter threads in one process, torchfix on;
* ``lock``: the same threads without torchfix, with the usual workaround: a lock held around each thread's
  first forward and backward (its compile), released when the thread reaches the gradient barrier (a lock
  held through the barrier would deadlock it). Installed here by wrapping two trainer methods; the trainer
  has no such lock;
* ``processes``: one process per replica (torchrun, N ranks x 1 drafter thread, each with its own target
  thread, ``--ranks-share-devices``: all on the one device, gradients all-reduced over gloo), no torchfix.

On CUDA, also with CUDA graphs (``--compile-mode reduce-overhead``: the drafter step's whole loss compiled
and replayed as CUDA graphs): ``threads+cg`` for every N, and ``processes+cg`` for 3 replicas; and one
drafter thread with every thread on one CUDA stream (``/1s``, ``--cuda-streams shared``) beside the
trainer's default of a stream per thread, which lets the target's forward overlap the drafter's step.

Two widths. ``tiny`` (the default): the tiny target and a 0.4 M-parameter drafter, where a step is Python
launching small kernels: the GIL-bound case. ``real``: the target from :mod:`bench.real_target` (839 M
parameters on CUDA, 10 M on the CPU) and a 5-layer drafter (273 M trainable on CUDA) over 1024-token
sequences, where the GPU bounds a step, as it does for the models users train drafters for.

Every configuration runs in fresh processes with the same global batch, seed and steps; tokens/s and MFU
are the trainer's own figures (after the first, compiling, step; MFU as ``dflash_train/flops.py`` counts
it). At the tiny width each run has fresh Inductor/Triton caches; at the real width the runs share one, so
that compiling a 1 B-parameter step once, not per row, is what the device time goes to (the first row's
first-step time includes it). Also reported: time until every drafter thread finished its first step,
peak memory, compiled graphs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
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

# The trainer as shipped, and then the fixes its torchfix applied (those whose trigger module the run imported),
# written to the file named by the first argument: what disabling one fix can change in such a run.
REPORTING_MAIN = r"""
import json, sys
from dflash_train import __main__ as cli

code = cli.main(sys.argv[2:])
torchfix = sys.modules.get("torchfix")
applied = [s.name for s in torchfix.status() if s.state.value == "applied"] if torchfix else []
with open(sys.argv[1], "w") as f:
    json.dump(applied, f)
sys.exit(code)
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
        flags += ["--tiny-target-steps=0", "--regenerate=0", "--backend=eager", "--drafter-layers=1", "--num-anchors=2"]
    return flags


# Row names of the --compile-mode and --cuda-streams runs; the defaults keep the bare way's name.
MODE_SUFFIX = {"default": "", "reduce-overhead": "+cg"}
STREAMS_SUFFIX = {"per-thread": "", "shared": "/1s"}

# (steps, global batch, sequence length, trainer flags) of the real width, per device kind
REAL_SIZES = {
    "cuda": (40, 12, 1024, ("--drafter-layers=5", "--block-size=16", "--num-anchors=64")),
    "cpu": (12, 6, 256, ("--drafter-layers=2", "--block-size=8", "--num-anchors=8")),  # batch: 1, 2 or 3 replicas
}


def one(
    mode: str,
    replicas: int,
    device: str,
    steps: int,
    batch: int,
    seq_len: int,
    quick: bool,
    compile_mode: str = "default",
    streams: str = "per-thread",
    *,
    disable: str = "",
    extra: tuple[str, ...] = (),
    compile_caches: Path | None = None,
) -> dict:
    """One run of the trainer. ``disable``: TORCHFIX_DISABLE for a ``threads`` run; ``extra``: more trainer
    flags (a later flag wins); ``compile_caches``: Inductor/Triton caches to share with other runs (default:
    fresh ones)."""
    label = mode + MODE_SUFFIX[compile_mode] + STREAMS_SUFFIX[streams]
    out = Path(tempfile.mkdtemp(prefix=f"bench-{label.replace('/', '-')}{replicas}-"))
    caches = compile_caches or out
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFIX_")}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"), TRITON_CACHE_DIR=str(caches / "triton"))
    flags = [*_flags(device, 1 if mode == "processes" else replicas, steps, batch, seq_len, quick), f"--out-dir={out}"]
    flags += extra
    if disable:
        env["TORCHFIX_DISABLE"] = disable
    if compile_mode != "default":
        flags.append(f"--compile-mode={compile_mode}")
    if streams != "per-thread":
        flags.append(f"--cuda-streams={streams}")
    if quick:
        flags.append(f"--cache-dir={out / 'cache'}")
    if mode == "threads":
        command = [sys.executable, "-c", REPORTING_MAIN, str(out / "applied_fixes.json"), *flags]
    elif mode == "lock":
        env["TORCHFIX_DISABLE"] = "1"
        command = [sys.executable, "-c", LOCKED_MAIN, *flags]
    else:
        env["TORCHFIX_DISABLE"] = "1"
        command = [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={replicas}"),
            *("-m", "dflash_train", *flags, "--ranks-share-devices"),
        ]
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    row: dict[str, object] = {"mode": label, "replicas": replicas, "compile_mode": compile_mode, "streams": streams}
    row["wall_s"] = round(time.perf_counter() - started, 1)  # the whole process: start, load, compile, steps, save
    row["out_dir"] = str(out)  # the run's outputs (metrics.jsonl, a profile), kept
    metrics = out / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if proc.returncode == 0 else []
    summary = next((r for r in records if r["type"] == "summary"), None)
    if summary is None:
        row |= {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1], "returncode": proc.returncode}
    else:
        row |= _figures(records, summary)
        applied = out / "applied_fixes.json"
        if applied.is_file():
            row["applied_fixes"] = json.loads(applied.read_text())
    # Each run as it ends: a benchmark cut short by a time limit still leaves the runs before it.
    print(f"bench run: TORCHFIX_DISABLE={disable!r} {json.dumps(row)}", file=sys.stderr, flush=True)
    return row


def _figures(records: list[dict], summary: dict) -> dict:
    """A finished run's figures, from its metrics.jsonl records."""
    memory = [r for r in records if r["type"] == "memory"]
    cuda_peak = sum(v for r in memory for k, v in r.items() if k.startswith("cuda"))
    dynamo = [r for r in records if r["type"] == "dynamo"]
    return {
        "tokens_per_s": summary["tokens_per_s"],
        "mfu": summary.get("mfu"),
        "all_first_steps_s": max(r["seconds"] for r in records if r["type"] == "first_step"),
        "cuda_peak_gib": round(cuda_peak, 3),
        "host_rss_gib": round(sum(r.get("host_rss", 0.0) for r in memory), 3),
        "unique_graphs": sum(r["unique_graphs"] for r in dynamo),
        "eager_fallback": any(r["eager_fallback"] for r in dynamo),
        # Graphs inductor compiled without the CUDA graphs asked for (the trainer logs why).
        "cudagraph_skips": sum(r.get("cudagraph_skips", 0) for r in dynamo),
    }


def configurations(device: str, counts: tuple[int, ...]) -> list[tuple[str, int, str, str]]:
    """The rows to run, as (way, replicas, --compile-mode, --cuda-streams): threads for every count, lock and
    processes from 2 replicas; on CUDA, threads with CUDA graphs for every count, processes with them for 3,
    and one drafter thread with all threads on one stream, in both modes."""
    cuda = device.startswith("cuda")
    modes = ("default", "reduce-overhead") if cuda else ("default",)
    runs = []
    for n in counts:
        for mode in modes:
            runs += [("threads", n, mode, "shared")] if cuda and n == 1 else []
            runs += [("threads", n, mode, "per-thread")]
        runs += [("lock", n, "default", "per-thread"), ("processes", n, "default", "per-thread")] if n > 1 else []
        runs += [("processes", n, "reduce-overhead", "per-thread")] if cuda and n == 3 else []
    return runs


def run(quick: bool = False, device: str = "cpu", width: str = "tiny", counts: tuple[int, ...] = (1, 2, 3)) -> dict:
    import torch

    kind = "cuda" if device.startswith("cuda") else "cpu"
    extra: tuple[str, ...] = ()
    caches, target_parameters = None, None
    if width == "real":
        from . import real_target

        steps, batch, seq_len, flags = REAL_SIZES[kind]
        work = Path(tempfile.mkdtemp(prefix="bench-trainer-real-"))
        shape = "gpu" if kind == "cuda" and not quick else "cpu"
        target = real_target.cached(shape)
        extra, caches, target_parameters = (
            (f"--target={target}", "--regenerate=0", *flags),
            work,
            real_target.parameters(shape),
        )
    elif kind == "cuda":
        steps, batch, seq_len = 120, 12, 256
    else:
        steps, batch, seq_len = 30, 6, 128
    if quick:  # every way (threads, lock, processes) once, at 2 replicas; on CUDA 1 too (its shared-stream rows)
        counts, steps, batch, seq_len = (1, 2) if kind == "cuda" else (2,), 4, 2, 64
        extra = (*extra, "--drafter-layers=1", "--num-anchors=2") if width == "real" else extra  # after its flags
    rows = [
        one(mode, n, device, steps, batch, seq_len, quick, compile_mode, streams, extra=extra, compile_caches=caches)
        for mode, n, compile_mode, streams in configurations(device, counts)
    ]
    threads = {r["replicas"]: r.get("tokens_per_s") for r in rows if r["mode"] == "threads"}
    for row in rows:
        base = threads.get(row["replicas"])
        if base and row.get("tokens_per_s"):
            row["vs_threads"] = round(row["tokens_per_s"] / base, 3)
    return {
        "torch": str(torch.__version__),
        "device": device,
        "width": width,
        "target_parameters": target_parameters,
        "steps": steps,
        "global_batch": batch,
        "seq_len": seq_len,
        "rows": rows,
    }


def table(result: dict) -> str:
    width = result.get("width", "tiny")
    target = f", target {result['target_parameters'] / 1e6:.0f} M parameters" if result.get("target_parameters") else ""
    lines = [
        f"torch {result['torch']}, {result['device']}, {width} width{target}, {result['steps']} steps, global batch "
        f"{result['global_batch']} x {result['seq_len']} tokens"
        + (" (the GIL-bound case: Python launching small kernels)" if width == "tiny" else "")
    ]
    if any(row.get("compile_mode") == "reduce-overhead" for row in result["rows"]):
        lines.append("+cg: --compile-mode reduce-overhead (the drafter step's loss as CUDA graphs)")
    if any(row.get("streams") == "shared" for row in result["rows"]):
        lines.append("/1s: --cuda-streams shared (every thread on the device's default stream)")
    for row in result["rows"]:
        label = f"{row['mode']:<15} x{row['replicas']}"
        if "error" in row:
            lines.append(f"{label}: failed (exit {row['returncode']}): {row['error']}")
            continue
        skips = row.get("cudagraph_skips", 0)
        mfu = f", MFU {row['mfu']:.1%}" if row.get("mfu") is not None else ""
        cuda = f", peak CUDA {row['cuda_peak_gib']:.2f} GiB" if result["device"].startswith("cuda") else ""
        lines.append(
            f"{label}: {row['tokens_per_s'] or 0:>9,.0f} tokens/s (x{row.get('vs_threads', 1.0):.2f} threads){mfu}, "
            f"all first steps {row['all_first_steps_s']:.1f} s{cuda}, "
            f"host RSS {row['host_rss_gib']:.2f} GiB, {row['unique_graphs']} graphs"
            f"{', EAGER FALLBACK' if row['eager_fallback'] else ''}"
            f"{f', CUDA GRAPHS SKIPPED {skips} TIMES' if skips else ''}"
        )
    return "\n".join(lines)
