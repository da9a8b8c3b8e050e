"""Threaded cold start: N threads each run the first step of the same compiled training step, cold.

Each configuration runs in a fresh interpreter with fresh Inductor/Triton cache folders (warm caches
hide both the cost and the races). Reported per N: seconds until every thread finished its first step,
the ratio to one thread, and how many graphs Dynamo compiled (one thread compiles one forward and one
backward; N threads should reuse them, not compile N times).

Goal: N threads <= 1.2x one thread, every thread reusing one compilation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

WORKER = r"""
import json, sys, threading, time
import torchfix, torch
from torch._dynamo.utils import counters

threads, width, backend, device = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]

def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
    ).to(device)

@torch.compile(backend=backend)
def train_step(model, x):
    loss = model(x).square().mean()
    loss.backward()
    return loss

models = [make_model() for _ in range(threads)]
inputs = [torch.randn(32, width, device=device) for _ in range(threads)]
go = threading.Barrier(threads + 1)
first_step = {}
errors = []

def worker(i):
    go.wait()
    try:
        train_step(models[i], inputs[i])
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        first_step[i] = time.perf_counter() - start
    except Exception as exc:
        errors.append(repr(exc))

pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
for t in pool:
    t.start()
start = time.perf_counter()
go.wait()
for t in pool:
    t.join()
print(json.dumps({
    "threads": threads,
    "all_first_step_s": max(first_step.values()) if first_step else None,
    "first_step_s": [round(first_step[i], 3) for i in sorted(first_step)],
    "unique_graphs": counters["stats"]["unique_graphs"],
    "frames_compiled": counters["stats"]["calls_captured"],
    "errors": errors,
}))
"""


def one(threads: int, width: int, backend: str, device: str, disable: bool) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(), TRITON_CACHE_DIR=tempfile.mkdtemp())
    env.pop("TORCHFIX_DISABLE", None)
    if disable:
        env["TORCHFIX_DISABLE"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, str(threads), str(width), backend, device],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    if proc.returncode != 0:
        return {"threads": threads, "error": proc.stderr.strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(quick: bool = False, device: str = "cpu") -> dict[str, object]:
    import torch

    width, backend, counts = (16, "eager", (1, 2)) if quick else (256, "inductor", (1, 2, 4))
    rows = [one(n, width, backend, device, disable=False) | {"torchfix": True} for n in counts]
    if not quick:  # the same without torchfix, to show what it prevents
        rows += [one(n, width, backend, device, disable=True) | {"torchfix": False} for n in counts[1:]]
    base = rows[0].get("all_first_step_s")
    for row in rows:
        if base and row.get("all_first_step_s"):
            row["ratio_to_one_thread"] = round(row["all_first_step_s"] / base, 2)
    return {"torch": str(torch.__version__), "device": device, "backend": backend, "width": width, "rows": rows}


def table(result: dict) -> str:
    lines = [f"torch {result['torch']}, {result['device']}, backend {result['backend']}, width {result['width']}"]
    for row in result["rows"]:
        label = f"{row['threads']} threads{'' if row['torchfix'] else ' (no torchfix)'}"
        if "error" in row:
            lines.append(f"{label}: failed: {row['error']}")
            continue
        lines.append(
            f"{label}: all first steps after {row['all_first_step_s']:.2f} s "
            f"(x{row.get('ratio_to_one_thread', 1.0):.2f} one thread), unique graphs {row['unique_graphs']}, "
            f"errors {len(row['errors'])} {row['errors'][:1]}"
        )
    return "\n".join(lines)
