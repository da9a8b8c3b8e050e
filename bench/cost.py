"""What torchfix costs a whole training step: dflash_train with one drafter thread, torchfix on vs off.

One target thread and one drafter thread on one device (no thread hazard at all, so torchfix can only
cost), at a realistic width: the target from :mod:`bench.real_target` (839 M parameters on CUDA, a 10 M
one on the CPU), a 5-layer drafter with block 16 and 64 anchors over 1024-token sequences on CUDA (smaller
on the CPU). Runs alternate in ABBA order (on, off, off, on, ...) so that drift of the machine falls on both
sides; each pair gives one on/off ratio of tokens/s, and the result is the ratio of the medians with the
pairs' spread (``--pairs 0``: none). ``--fixes`` adds one run per fix with only that fix disabled, against the
median of the runs with all of them on: each fix that those runs applied (each run records them; a fix whose
trigger module the trainer never imports is never applied, and disabling it changes nothing), or only those
named (``--fixes a,b``: a schedule spread over sessions). ``--profile``
adds one run each way with ``--profile-steps`` over the middle half of the run (torch.profiler, every thread,
CUDA kernels on GPU), right after the warm-up, and compares them op by op, per step: where the difference is.

All runs share one Inductor/Triton cache, filled by a first run that is not counted: what is measured is
the steady step, not compilation, and every counted run then compiles the same way.

A run of the whole schedule outlasts many job limits (35 - 55 s a run on the H200; 5 pairs, a profile and
a run per fix make over 50 runs), so it can be resumed: ``state`` (``python -m bench cost --out DIR`` keeps it in
``DIR/cost-state``) records each finished run, and a later invocation with the same state runs only what is
missing, after its own uncounted warm-up where the compile caches are not there (another machine). Each run
names its machine, and the table says when the runs came from more than one.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from . import real_target
from .trainer import REAL_SIZES, one


def run(
    quick: bool = False,
    device: str = "cpu",
    pairs: int = 5,
    fixes: list[str] | None = None,
    profile: bool = False,
    state: Path | None = None,
) -> dict[str, object]:
    import torch

    import torchfix

    unknown = sorted(set(fixes or ()) - {s.name for s in torchfix.status()})
    if unknown:  # before any run: a typo must not cost a schedule
        raise SystemExit(f"bench cost --fixes: no fix named {', '.join(unknown)} (python -m torchfix lists them)")
    kind = "cuda" if device.startswith("cuda") else "cpu"
    steps, batch, seq_len, flags = REAL_SIZES[kind]
    if quick:
        steps, batch, seq_len, pairs, flags = 3, 2, 64, 1, ("--drafter-layers=1", "--num-anchors=2")
    work = Path(state) if state else Path(tempfile.mkdtemp(prefix="bench-cost-"))
    work.mkdir(parents=True, exist_ok=True)
    target = real_target.cached("gpu" if kind == "cuda" and not quick else "cpu")
    extra = (
        f"--target={target}",
        "--regenerate=0",
        "--drafter-threads-per-device=1",
        f"--cache-dir={work / 'cache'}",
        *flags,
    )
    shape = (device, steps, batch, seq_len, False)
    ledger = _Ledger(work / "runs.jsonl", (*shape, quick, str(torch.__version__), _source_digest(torchfix)))
    warmups: list[dict] = []

    def attempt(disable: str, profile_window: str = "") -> dict:
        # Without torchfix even this job has a thread hazard: its target and drafter threads compile at once (H1
        # seen in 1 of 6 runs without it on the H200, a profiled one). A failed run is tried again; its errors are kept.
        failed: list[str] = []
        for tried in range(1, ATTEMPTS + 1):
            more = (f"--profile-steps={profile_window}",) if profile_window else ()
            row = one("threads", 1, *shape, extra=(*extra, *more), compile_caches=work, disable=disable)
            profile = _profile_of(row) if profile_window else None  # read before the run's folder goes
            # A run's folder holds the drafter it saved (a few GB at this width): 20 of them filled the H200
            # machine's 64 GB disk, and every run after that failed.
            shutil.rmtree(row["out_dir"], ignore_errors=True)
            if "error" not in row or tried == ATTEMPTS:
                break
            failed.append(str(row["error"]))
        row |= {"disabled": disable, "failed_attempts": failed, "machine": platform.node()}
        return row if profile is None else row | {"profile_ops": profile}

    def measure(slot: str, disable: str, profile_window: str = "") -> dict:
        """The run of ``slot``: recorded by an earlier invocation, or run now (after a warm-up, where this
        machine's compile caches are still empty)."""
        if slot not in ledger:
            if not warmups and not (work / "inductor").is_dir():
                warmups.append(attempt(""))  # fills the compile caches; not counted
            row = attempt(disable, profile_window)
            if "error" in row:  # not recorded: a resumed run tries it again
                return row
            ledger.record(slot, row)
        return ledger[slot]

    result: dict[str, object] = {
        "torch": str(torch.__version__),
        "device": device,
        "target_parameters": real_target.parameters("gpu" if kind == "cuda" and not quick else "cpu"),
        "steps": steps,
        "global_batch": batch,
        "seq_len": seq_len,
        "warmups": warmups,
        "resumed_runs": len(ledger),
    }
    if profile:  # before the pairs: a run cut short by a time limit still has it (printed as it ends)
        # The middle half of the run: long enough that a window's part-steps (see STEP_MARKER) weigh little.
        window = f"{max(1, steps // 4)}:{steps - steps // 4}"
        profiled = {
            label: measure(f"profile {label}", disable, window) for label, disable in (("on", ""), ("off", "1"))
        }
        result["profiled_runs"] = profiled
        result["profile"] = profile_diff(*(profiled[label]["profile_ops"] for label in ("on", "off")))
        print(f"bench profile: {json.dumps(result['profile'])}", file=sys.stderr, flush=True)
    order = (("on", ""), ("off", "1"), ("off", "1"), ("on", ""))  # ABBA
    runs = [
        measure(f"pair {i} run {j} {label}", disable) for i in range(pairs) for j, (label, disable) in enumerate(order)
    ]
    on = [r.get("tokens_per_s") or 0.0 for r in runs if r["disabled"] == ""]
    off = [r.get("tokens_per_s") or 0.0 for r in runs if r["disabled"] == "1"]
    pair_ratios = [(a + b) / (c + d) for a, b, c, d in zip(on[0::2], on[1::2], off[0::2], off[1::2]) if c + d]
    result |= {
        "runs": runs,
        "on_tokens_per_s": on,
        "off_tokens_per_s": off,
        "ratio_of_medians": statistics.median(on) / statistics.median(off) if off and statistics.median(off) else None,
        "pair_ratios": pair_ratios,
    }
    if fixes is not None:
        base = statistics.median(on) if on else None
        known = [s.name for s in torchfix.status() if s.state.value in ("applied", "pending import")]
        known = [name for name in known if not fixes or name in fixes]
        chosen, result["never_applied"] = fixes_to_disable(known, runs)
        result["one_fix_disabled"] = [measure(f"without {name}", name) | {"vs_all_on": None} for name in chosen]
        for row in result["one_fix_disabled"]:
            row["vs_all_on"] = (row.get("tokens_per_s") or 0.0) / base if base else None
    result["machines"] = sorted({r["machine"] for r in (*warmups, *ledger.rows()) if "machine" in r})
    return result


def fixes_to_disable(known: list[str], runs: list[dict]) -> tuple[list[str], list[str]]:
    """The fixes to run disabled in turn, and those not: a fix that no run with torchfix applied (its trigger module
    never imported) changes nothing when disabled. Runs that did not record their fixes (older ledgers) count as
    having applied every fix."""
    recorded = [r["applied_fixes"] for r in runs if r["disabled"] == "" and "applied_fixes" in r]
    applied = set().union(*recorded) if recorded else set(known)
    return [name for name in known if name in applied], [name for name in known if name not in applied]


def _source_digest(package: object) -> str:
    """A digest of a package's Python sources: runs of another torchfix are not mixed into a resumed schedule."""
    files = sorted(Path(package.__file__).parent.rglob("*.py"))
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]


class _Ledger:
    """The finished runs of one schedule, one JSON line each (a slot and its row), so that an interrupted run
    can go on. A ledger written for another shape (device, sizes, torch, torchfix's sources) is refused rather than
    mixed in."""

    def __init__(self, path: Path, shape: tuple) -> None:
        self.path, self.shape = path, json.loads(json.dumps(shape))
        self._rows: dict[str, dict] = {}
        text = path.read_text() if path.is_file() else ""
        if text and not text.endswith("\n"):
            with path.open("a") as f:  # end a line cut short, so that the next record starts a line of its own
                f.write("\n")
        for number, line in enumerate(text.splitlines(), 1):
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a killed run: that run is simply run again
                print(f"bench cost: {path}:{number} is not a whole record; its run is run again", file=sys.stderr)
                continue
            if entry.get("shape") != self.shape:
                raise SystemExit(
                    f"bench cost: {path} holds runs of another shape {entry.get('shape')}; use another --out"
                )
            self._rows[entry["slot"]] = entry["row"]

    def __contains__(self, slot: str) -> bool:
        return slot in self._rows

    def __getitem__(self, slot: str) -> dict:
        return self._rows[slot]

    def __len__(self) -> int:
        return len(self._rows)

    def rows(self) -> list[dict]:
        return list(self._rows.values())

    def record(self, slot: str, row: dict) -> None:
        self._rows[slot] = row
        with self.path.open("a") as f:  # one write per line: a kill leaves at most one partial line
            f.write(json.dumps({"slot": slot, "shape": self.shape, "row": row}) + "\n")


ATTEMPTS = 3  # per run


def _profile_of(row: dict) -> dict:
    path = Path(row.get("out_dir", "")) / "profile" / "ops.json"
    return json.loads(path.read_text()) if path.is_file() else {"steps": 1, "ops": []}


# The profiler's record of an AdamW step: one per replica and step. The window of a profile starts and ends when
# the main thread reads a step's report, while the threads go on (the target thread a step or two ahead), so
# the ops are divided by the optimizer steps the window holds, not by the steps it was asked for.
STEP_MARKER = "Optimizer.step#AdamW.step"


def _steps_in(profile: dict) -> float:
    return next((o["calls"] for o in profile["ops"] if o["op"] == STEP_MARKER), profile["steps"]) or 1


def profile_diff(on: dict, off: dict, top: int = 12) -> dict[str, object]:
    """Two profiles (``dflash_train/profiling.py``'s ops.json, with torchfix and without) per optimizer step: the
    totals, the ops called at least once a step (and 5 %) more or less often, and those whose self time differs
    most."""
    per_step = {
        label: {o["op"]: (o["calls"] / n, o["self_cpu_us"] / n, o["self_device_us"] / n) for o in p["ops"]}
        for label, p in (("on", on), ("off", off))
        for n in [_steps_in(p)]
    }
    none = (0.0, 0.0, 0.0)
    device = any(v[2] for ops in per_step.values() for v in ops.values())
    timed = 2 if device else 1  # compare device time where there is any, else CPU time
    rows = [
        {
            "op": op,
            "calls": [per_step["on"].get(op, none)[0], per_step["off"].get(op, none)[0]],
            "self_us": [per_step["on"].get(op, none)[timed], per_step["off"].get(op, none)[timed]],
        }
        for op in sorted({*per_step["on"], *per_step["off"]})
    ]
    # The target thread's ops can be a part-step off the drafter's in a window: a few per cent of their calls.
    differ = [r for r in rows if abs(r["calls"][0] - r["calls"][1]) >= max(1.0, 0.05 * max(r["calls"]))]
    largest = sorted(rows, key=lambda r: -abs(r["self_us"][0] - r["self_us"][1]))[:top]
    return {
        "time": "self device time" if device else "self CPU time",
        "total_us_per_step": [sum(v[timed] for v in per_step[label].values()) for label in ("on", "off")],
        "calls_differ": differ,
        "largest_time_differences": largest,
    }


def table(result: dict) -> str:
    lines = [
        f"torch {result['torch']}, {result['device']}, target {result['target_parameters'] / 1e6:.0f} M parameters, "
        f"1 drafter thread, {result['steps']} steps, global batch {result['global_batch']} x {result['seq_len']}"
    ]
    if len(result.get("machines", ())) > 1:
        lines.append(f"runs from {len(result['machines'])} machines (resumed): {', '.join(result['machines'])}")
    every = [*result["warmups"], *result.get("profiled_runs", {}).values(), *result["runs"]]
    every += result.get("one_fix_disabled", [])
    lines += [
        f"a run failed and was tried again (TORCHFIX_DISABLE={r['disabled']!r}): {error}"
        for r in every
        for error in r["failed_attempts"]
    ]
    lines += [f"a run failed (TORCHFIX_DISABLE={r['disabled']!r}): {r['error']}" for r in every if "error" in r]
    on, off = result["on_tokens_per_s"], result["off_tokens_per_s"]
    lines.append("tokens/s with torchfix:    " + ", ".join(f"{v:,.0f}" for v in on))
    lines.append("tokens/s without torchfix: " + ", ".join(f"{v:,.0f}" for v in off))
    if result["ratio_of_medians"] is not None:
        spread = result["pair_ratios"]
        lines.append(
            f"with / without: {result['ratio_of_medians']:.4f} (medians); ABBA pairs {min(spread):.4f} - "
            f"{max(spread):.4f}"
        )
    if "profile" in result:
        diff = result["profile"]
        with_, without = (t / 1000 for t in diff["total_us_per_step"])
        lines.append(f"profile, {diff['time']} per step: {with_:.2f} ms with torchfix, {without:.2f} ms without")
        for title, rows in (
            ("calls differ", diff["calls_differ"]),
            ("largest time differences", diff["largest_time_differences"]),
        ):
            lines.append(f"  {title}:" + ("" if rows else " none"))
            lines += [
                f"    {r['op'][:60]:<60} calls {r['calls'][0]:>8.1f} / {r['calls'][1]:<8.1f} "
                f"{r['self_us'][0] / 1000:>8.3f} / {r['self_us'][1] / 1000:.3f} ms"
                for r in rows
            ]
    if result.get("never_applied"):
        lines.append(f"not applied in the runs with torchfix (not run disabled): {', '.join(result['never_applied'])}")
    for row in result.get("one_fix_disabled", []):
        versus = f" (x{row['vs_all_on']:.4f})" if row["vs_all_on"] is not None else ""
        lines.append(f"without {row['disabled']}: {row.get('tokens_per_s') or 0:,.0f} tokens/s{versus}")
    return "\n".join(lines)
