"""python -m bench instructions: the machine instructions of one compiled call, with torchfix and without, counted.

The timed ratios of ``bench overhead`` move by about 1 % between identical blocks; a compiled call's cost that
torchfix adds is a fraction of that. Valgrind's callgrind counts the instructions the CPU executes (``Ir``) in a
window of the process, whatever the load: here 1,000 calls of a compiled function and of a compiled module
(``backend="eager"``, the call's Python and C work and nothing else), after a warm-up, in fresh interpreters with
torchfix imported first and without it. A process's string hashes (``PYTHONHASHSEED``) decide how often its dict
lookups collide, which moves the count by up to ~0.6 % between two processes running the same code: each side
runs under several seeds (the same seeds on both), and the ratio is of the means, with each seed's ratio
beside it. The per-function difference of one seed (``callgrind_annotate``) says where the added instructions go.
Needs ``valgrind`` on PATH (the row says so where it is missing); ~1 minute a process.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# ``python -c LOOP WITH KIND CALLS``: warm up, say "ready", wait for a line (callgrind's counting is switched on
# then), make the calls, say "done", wait for a line (counting off), exit.
LOOP = r"""
import sys
if sys.argv[1] == "1":
    import torchfix  # noqa: F401
import torch
kind, calls = sys.argv[2], int(sys.argv[3])
x = torch.ones(4)
compiled = torch.compile(torch.nn.Linear(4, 4) if kind == "module" else (lambda t: t + 1), backend="eager")
for _ in range(50):
    compiled(x)
print("ready", flush=True)
sys.stdin.readline()
for _ in range(calls):
    compiled(x)
print("done", flush=True)
sys.stdin.readline()
"""

KINDS = ("function", "module")


def _count(with_torchfix: bool, kind: str, calls: int, seed: int, out: Path) -> int:
    """The instructions of ``calls`` calls in one fresh interpreter under callgrind."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFIX_")}
    env |= {"PYTHONHASHSEED": str(seed), "OMP_NUM_THREADS": "1"}
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
    command += [sys.executable, "-c", LOOP, "1" if with_torchfix else "0", kind, str(calls)]
    proc = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )

    def step(said: str, switch: str) -> None:
        line = proc.stdout.readline().strip()
        if line != said:
            proc.kill()
            raise RuntimeError(f"the {kind} loop said {line!r}, not {said!r} (exit {proc.wait()})")
        subprocess.run(["callgrind_control", "--instr=" + switch, str(proc.pid)], check=True, capture_output=True)
        proc.stdin.write("\n")
        proc.stdin.flush()

    step("ready", "on")
    step("done", "off")
    proc.wait(timeout=600)
    return total(out.read_text())


def total(profile: str) -> int:
    """The instructions a callgrind profile counted while counting was on: its ``totals:`` line (its ``summary:``
    line counts from the process's start, which ``--instr-atstart=no`` leaves at 0)."""
    for line in profile.splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise RuntimeError("no instruction total in the profile")


def _where(without: Path, with_fix: Path, calls: int, most: int = 8) -> list[str]:
    """The functions whose instructions per call differ most between the two profiles, with and without (by name:
    the same function can be counted under two libraries that both hold a copy)."""

    def per_function(path: Path) -> dict[str, int]:
        text = subprocess.run(
            ["callgrind_annotate", "--inclusive=no", "--threshold=100", str(path)], capture_output=True, text=True
        ).stdout
        counts = {}
        for line in text.splitlines():
            number, _, rest = line.strip().partition(" ")
            if number.replace(",", "").isdigit() and "(" in rest and "PROGRAM TOTALS" not in rest:
                name = rest.split(")", 1)[1].split(" [")[0].rsplit("/", 1)[-1].strip()  # file:function
                counts[name] = counts.get(name, 0) + int(number.replace(",", ""))
        return counts

    a, b = per_function(without), per_function(with_fix)
    diffs = sorted(((b.get(f, 0) - a.get(f, 0), f) for f in {*a, *b}), key=lambda d: -abs(d[0]))
    return [f"{d / calls:+,.0f} {f}" for d, f in diffs[:most]]


def run(quick: bool = False, runs: int = 3) -> dict[str, object]:
    import torch

    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        return {"torch": str(torch.__version__), "skipped": "valgrind is not installed here"}
    calls, seeds = (20, [0]) if quick else (1000, list(range(max(runs, 1))))
    result: dict[str, object] = {"torch": str(torch.__version__), "python": sys.version.split()[0], "calls": calls}
    with tempfile.TemporaryDirectory() as folder:
        for kind in KINDS:
            counts = {True: [], False: []}
            for seed in seeds:  # the sides in turn, seed by seed
                for with_fix in (False, True):
                    out = Path(folder) / f"{kind}-{seed}-{int(with_fix)}.out"
                    counts[with_fix].append(_count(with_fix, kind, calls, seed, out) / calls)
            with_mean, without_mean = statistics.mean(counts[True]), statistics.mean(counts[False])
            result[kind] = {
                "per_call_with_torchfix": with_mean,
                "per_call_without_torchfix": without_mean,
                # as the timed rows: rate with / rate without, the inverse of the instructions' ratio
                "ratio": without_mean / with_mean,
                "ratio_per_seed": [b / a for a, b in zip(counts[True], counts[False])],
                "seeds": seeds,
                "where_first_seed": _where(*(Path(folder) / f"{kind}-{seeds[0]}-{side}.out" for side in (0, 1)), calls),
            }
    return result


def table(result: dict) -> str:
    if "skipped" in result:
        return f"torch {result['torch']}: {result['skipped']}"
    lines = [f"torch {result['torch']}, Python {result['python']}, {result['calls']} calls per process"]
    for kind in KINDS:
        r = result[kind]
        seeds = ", ".join(f"{ratio:.4f}" for ratio in r["ratio_per_seed"])
        lines.append(
            f"compiled {kind} call: {r['per_call_with_torchfix']:,.0f} instructions with torchfix, "
            f"{r['per_call_without_torchfix']:,.0f} without: ratio {r['ratio']:.4f} (per seed: {seeds})"
        )
        lines += [f"    {line[:120]}" for line in r["where_first_seed"]]
    return "\n".join(lines)
