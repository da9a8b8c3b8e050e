"""The first compile: seconds from a fresh interpreter's start to its first compiled training step done, with
torchfix and without.

One thread, cold caches: each run is a new interpreter with new, empty ``TORCHINDUCTOR_CACHE_DIR`` and
``TRITON_CACHE_DIR`` folders. torchfix's own cache (the patched sources, written once per torch install) is
filled by one run with torchfix before the pairs, reported by itself (not with ``--quick``): on a fresh machine it
would otherwise land in the first pair only. The step is
what a trainer's first step is: a small MLP compiled with inductor, its forward, its backward (compiled as it is
first run) and an optimizer step. Without torchfix is a run that never imports it. Runs go in pairs, ABBA (with
first, then without first), and the ratio is the median of the pairs' ratios, with the lowest and highest.

Goal: with / without <= 1.05.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

WORKER = r"""
import json, sys, time
with_torchfix, device, width, backend = sys.argv[1] == "1", sys.argv[2], int(sys.argv[3]), sys.argv[4]
marks = {"start": time.time()}
import torch
marks["torch"] = time.time()
if with_torchfix:
    import torchfix
marks["torchfix"] = time.time()
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
compiled = torch.compile(model, backend=backend)
x = torch.randn(32, width, device=device)
compiled(x).square().mean().backward()
optimizer.step()
if device.startswith("cuda"):
    torch.cuda.synchronize()
marks["step"] = time.time()
print(json.dumps(marks))
"""


def one(with_torchfix: bool, device: str, width: int, backend: str) -> dict[str, float]:
    """One run: seconds from before the interpreter started to the first step done, and its parts."""
    folder = tempfile.mkdtemp(prefix="torchfix-firststep-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFIX_")}
    env |= {"TORCHINDUCTOR_CACHE_DIR": f"{folder}/inductor", "TRITON_CACHE_DIR": f"{folder}/triton"}
    try:
        started = time.time()
        proc = subprocess.run(
            [sys.executable, "-c", WORKER, "1" if with_torchfix else "0", device, str(width), backend],
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    marks = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "total_s": marks["step"] - started,
        "interpreter_s": marks["start"] - started,
        "import_torch_s": marks["torch"] - marks["start"],
        "import_torchfix_s": marks["torchfix"] - marks["torch"],
        "first_step_s": marks["step"] - marks["torchfix"],
    }


def run(quick: bool = False, device: str = "cpu", pairs: int = 3) -> dict[str, object]:
    import torch

    width, backend, pairs = (16, "eager", 1) if quick else (256, "inductor", max(pairs, 1))
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    cache_filled = None if quick else one(True, device, width, backend)
    ratios = []
    for pair in range(pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        got = {with_torchfix: one(with_torchfix, device, width, backend) for with_torchfix in order}
        for with_torchfix, row in got.items():
            runs[with_torchfix].append(row)
        if all("total_s" in row for row in got.values()):
            ratios.append(got[True]["total_s"] / got[False]["total_s"])
    result: dict[str, object] = {"torch": str(torch.__version__), "device": device, "backend": backend}
    result |= {"width": width, "pairs": pairs, "runs": {"with": runs[True], "without": runs[False]}}
    result["torchfix_cache_filled"] = cache_filled
    if ratios:
        result |= {"ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
    for label, rows in (("with", runs[True]), ("without", runs[False])):
        done = [row for row in rows if "total_s" in row]
        if done:
            result[f"{label}_median"] = {key: statistics.median(row[key] for row in done) for key in done[0]}
    return result


def table(result: dict) -> str:
    lines = [
        f"torch {result['torch']}, {result['device']}, backend {result['backend']}, width {result['width']}, "
        f"{result['pairs']} ABBA pair(s), fresh interpreter and empty Inductor/Triton caches per run"
    ]
    for label in ("with", "without"):
        median = result.get(f"{label}_median")
        errors = [row["error"] for row in result["runs"][label] if "error" in row]
        if median:
            lines.append(
                f"{label + ' torchfix':<17} first step done {median['total_s']:.2f} s after the start (median): "
                f"interpreter {median['interpreter_s']:.2f}, import torch {median['import_torch_s']:.2f}, "
                f"import torchfix {median['import_torchfix_s']:.2f}, compile and step {median['first_step_s']:.2f}"
            )
        lines += [f"{label + ' torchfix':<17} failed: {error}" for error in errors]
    filled = result["torchfix_cache_filled"]
    if filled:
        lines.append(
            f"{'before the pairs':<17} "
            + (
                f"a run with torchfix filled its cache: first step done {filled['total_s']:.2f} s after the start"
                if "total_s" in filled
                else f"the run filling torchfix's cache failed: {filled['error']}"
            )
        )
    if "ratio" in result:
        lines.append(
            f"with / without: {result['ratio']:.3f} (pairs {result['ratio_min']:.3f} - {result['ratio_max']:.3f})"
        )
    return "\n".join(lines)
