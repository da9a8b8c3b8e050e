"""CUDA graphs across threads: how many runs of ``tests/cuda_graph_threads.py`` pass, per configuration.

Each run is a fresh interpreter with fresh Inductor/Triton cache folders: 3 threads train their own
attention block (or MLP) compiled with ``mode="reduce-overhead"``, every step checked against an eager twin. The
configurations turn the cudagraph fixes off one at a time (TORCHFIX_DISABLE), with and without
``cudagraph_mark_step_begin()`` each step, so each row says which failure a part of the fix removes.
CUDA only; ``--quick`` runs one configuration once, a smoke test. ``--parallel N`` keeps N runs going at
once (each its own process; one H200 has room for many), the longest configurations first, and prints each
run's outcome to stderr as it ends, so that a run cut short by a time limit still leaves the ones before.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "cuda_graph_threads.py"
# (label, TORCHFIX_DISABLE, mark-step each step, generations of threads, MLP instead of attention)
CONFIGS = [
    ("torchfix", "", False, 1, False),
    ("torchfix, mark-step", "", True, 1, False),
    ("without cudagraph-thread-trees", "cudagraph-thread-trees", False, 1, False),
    ("without cudagraph-tree-callable", "cudagraph-tree-callable", False, 1, False),
    ("without cudagraph-step-counters, mark-step", "cudagraph-step-counters", True, 1, False),
    ("without cudagraph-step-counters", "cudagraph-step-counters", False, 1, False),
    ("without torchfix", "1", False, 1, False),
    # Threads that end: rounds of 3 threads, 8 steps each. On torch 2.11 torchfix before 3a4f4d7 (no
    # release of a thread's stash entries at its end) crashed these (SIGSEGV or corrupted objects).
    ("torchfix, threads ending (20 x 8 steps), mark-step", "", True, 20, False),
    ("torchfix, threads ending (40 x 8 steps, MLP), mark-step", "", True, 40, True),
]


def one(disable: str, mark_step: bool, steps: int, generations: int, mlp: bool, timeout: float) -> dict:
    caches = tempfile.mkdtemp(prefix="bench-cudagraphs-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFIX_")}
    env.update(TORCHINDUCTOR_CACHE_DIR=f"{caches}/inductor", TRITON_CACHE_DIR=f"{caches}/triton")
    if disable:
        env["TORCHFIX_DISABLE"] = disable
    command = [sys.executable, str(SCRIPT), "--steps", str(steps), "--generations", str(generations)]
    command += ["--timeout", str(timeout)]
    command += ["--mark-step"] if mark_step else []
    command += ["--mlp"] if mlp else []
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout + 60)
    except subprocess.TimeoutExpired:
        return {"passed": False, "outcome": "killed after the timeout"}
    lines = proc.stdout.strip().splitlines()
    if not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {
            "passed": False,
            "outcome": f"died (exit {proc.returncode}): {tail[:200]}",
            "stderr_tail": proc.stderr[-6000:],
        }
    report = json.loads(lines[-1])
    if report["hung"]:
        outcome = f"hung: {', '.join(report['hung'])}"
    elif report["errors"]:
        outcome = f"{len(report['errors'])} of {len(report['steps_done'])} threads failed: " + "; ".join(
            sorted(set(report["errors"].values()))
        )
    else:
        worst = max(report["max_diff"].values())
        outcome = f"all threads {steps * generations} steps equal to eager (max diff {worst:.2g})"
    result = {"passed": proc.returncode == 0, "outcome": outcome, "wall_s": report["wall_s"]}
    # A failed run's tracebacks (or, for a crash, every thread's stack), for the JSON: what to look into.
    return result if result["passed"] else result | {"stderr_tail": proc.stderr[-6000:]}


def run(quick: bool = False, runs: int = 3, configs: str = "", parallel: int = 1) -> dict[str, object]:
    """``configs``: indices into CONFIGS, comma-separated (default: all); ``parallel``: runs at once."""
    import torch

    if not torch.cuda.is_available():
        return {"torch": str(torch.__version__), "rows": [], "skipped": "needs a CUDA device"}
    chosen = [CONFIGS[int(i)] for i in configs.split(",")] if configs else CONFIGS
    chosen, runs, steps = (chosen[:1], 1, 5) if quick else (chosen, runs, 40)

    def job(config: tuple) -> dict:
        label, disable, mark_step, generations, mlp = config
        # Without torchfix the threads deadlock (H5): one short run says so.
        timeout = 120.0 if disable == "1" else 240.0
        result = one(disable, mark_step, steps if generations == 1 else 8, generations, mlp, timeout)
        print(f"{label}: {result['outcome']}", file=sys.stderr, flush=True)
        return result

    # The deadlocking and the many-generation configurations take longest: started first.
    order = sorted(range(len(chosen)), key=lambda i: (chosen[i][1] != "1", -chosen[i][3]))
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        futures = {i: [pool.submit(job, chosen[i]) for _ in range(runs)] for i in order}
    rows = []
    for i, config in enumerate(chosen):
        results = [future.result() for future in futures[i]]
        rows.append({"config": config[0], "passed": sum(r["passed"] for r in results), "runs": results})
    return {
        "torch": str(torch.__version__),
        "device": torch.cuda.get_device_name(),
        "steps": steps,
        "parallel": parallel,
        "rows": rows,
    }


def table(result: dict) -> str:
    if result.get("skipped"):
        return f"torch {result['torch']}: skipped ({result['skipped']})"
    at_once = f", {result['parallel']} runs at once" if result.get("parallel", 1) > 1 else ""
    lines = [f"torch {result['torch']}, {result['device']}, 3 threads, {result['steps']} steps, cold caches{at_once}"]
    for row in result["rows"]:
        lines.append(f"{row['config']}: {row['passed']} of {len(row['runs'])} runs passed")
        lines += [f"    {r['outcome']}" for r in row["runs"]]
    return "\n".join(lines)
