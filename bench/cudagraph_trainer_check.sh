#!/usr/bin/env bash
# The acceptance run of --compile-mode reduce-overhead (issue 11), on the GPU machine:
#
#   PYTHONPATH=. bash bench/cudagraph_trainer_check.sh OUT_DIR
#
# from the repository root. 1 target thread + 3 drafter threads on cuda:0, 300 steps, global batch 12,
# torchfix on, twice with fresh Inductor/Triton caches: with --compile-mode reduce-overhead (the drafter
# step's loss as CUDA graphs), then with --compile-mode default (today's path) for the loss
# curve to compare against. Prints each run's tokens/s, graphs, eager fallback, CUDA graph skips,
# first-step times, final loss and tau, then the largest difference of the two loss curves; writes both
# runs (metrics.jsonl, log.txt, ...) under OUT_DIR/reduce-overhead and OUT_DIR/default, and
# OUT_DIR/comparison.json. Needs no network. Exit status: 0 when both runs finished.
#
# Environment: PYTHON (default: python), STEPS (300), EXTRA_FLAGS (more trainer flags, for both runs).
# The tiny target and its regenerated data come from the trainer's cache (~/.cache/dflash_train, or
# --cache-dir in EXTRA_FLAGS); a first, uncompiled one-step run fills it if needed, so that neither
# measured run's first-step time includes training the target.
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: PYTHONPATH=. bash $0 OUT_DIR   (from the repository root)" >&2
    exit 2
fi
out=$1
python=${PYTHON:-python}
steps=${STEPS:-300}
read -r -a extra <<<"${EXTRA_FLAGS:-}"
if [[ ! -d dflash_train ]]; then
    echo "$0: run it from the repository root (with PYTHONPATH=.)" >&2
    exit 2
fi
for mode in reduce-overhead default; do
    if [[ -e $out/$mode ]]; then
        echo "$0: $out/$mode exists already: give a new OUT_DIR (the runs need fresh compile caches)" >&2
        exit 2
    fi
done
mkdir -p "$out"
unset TORCHFIX_DISABLE  # torchfix on, every fix
export PYTHONPATH=${PYTHONPATH:-.}

job=(--target-devices cuda:0 --drafter-devices cuda:0 --drafter-threads-per-device 3 --batch-size 12)

"$python" - <<'EOF'
import torch
import torchfix
import torch._dynamo.convert_frame, torch._inductor.compile_fx, torch._inductor.cudagraph_trees  # noqa: E401,F401

if not torch.cuda.is_available():
    raise SystemExit(f"no CUDA device here (torch {torch.__version__}): run this on the GPU machine")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
for line in torchfix.status():
    print(f"  {line}")
EOF

echo "== preparing the tiny target and its data (cached; no compilation)"
"$python" -m dflash_train "${job[@]}" --steps 1 --no-compile --eval-prompts 0 --save-every 0 --no-progress \
    --out-dir "$out/prepare" ${extra[@]+"${extra[@]}"} >"$out/prepare.log" 2>&1 || {
    echo "$0: the preparation run failed; see $out/prepare.log" >&2
    tail -20 "$out/prepare.log" >&2
    exit 1
}

failed=0
for mode in reduce-overhead default; do
    echo "== --compile-mode $mode: $steps steps, fresh compile caches in $out/$mode"
    mkdir -p "$out/$mode"
    rc=0
    PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR="$out/$mode/inductor" TRITON_CACHE_DIR="$out/$mode/triton" \
        "$python" -m dflash_train "${job[@]}" --steps "$steps" --compile-mode "$mode" --no-progress \
        --out-dir "$out/$mode" ${extra[@]+"${extra[@]}"} 2>&1 | tee "$out/$mode/log.txt" || rc=$?
    echo "== --compile-mode $mode: exit status $rc"
    [[ $rc -eq 0 ]] || failed=1
done

"$python" - "$out" <<'EOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
runs = {}
for mode in ("reduce-overhead", "default"):
    path = out / mode / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    summary = next((r for r in records if r["type"] == "summary"), None)
    if summary is None:
        print(f"{mode}: no summary in {path}: the run failed (see {out / mode / 'log.txt'})")
        continue
    dynamo = next(r for r in records if r["type"] == "dynamo")
    memory = next((r for r in records if r["type"] == "memory"), {})
    firsts = {r["thread"]: r["seconds"] for r in records if r["type"] == "first_step"}
    loss = {r["step"]: r["loss"] for r in records if r["type"] == "train"}
    runs[mode] = loss
    fallback = "EAGER FALLBACK" if dynamo["eager_fallback"] else "no eager fallback"
    print(
        f"{mode}: {summary['steps_done']} steps, {summary['tokens_per_s'] or 0:,.0f} tokens/s, "
        f"{dynamo['unique_graphs']} graphs, {fallback} (graph breaks {dynamo['graph_breaks']}, frames not "
        f"compiled {dynamo['frames_failed']}), CUDA graph skips {dynamo.get('cudagraph_skips')}, peak CUDA "
        f"{memory.get('cuda:0', 0):.2f} GiB"
    )
    print("  first step done (from the job's start): " + ", ".join(f"{t} {s:.1f} s" for t, s in firsts.items()))
    tau = [f"{t:.2f}" if t is not None else "-" for t in (summary["tau_before"], summary["tau_after"])]
    print(f"  final loss {summary['final_loss']:.5f}; tau {tau[0]} -> {tau[1]}")
comparison = {}
if len(runs) == 2:
    a, b = runs["reduce-overhead"], runs["default"]
    steps = sorted(set(a) & set(b))
    diffs = [abs(a[s] - b[s]) for s in steps]
    worst = max(range(len(steps)), key=diffs.__getitem__)
    rel = max(d / abs(b[s]) for d, s in zip(diffs, steps) if b[s])
    comparison = {
        "steps_compared": len(steps),
        "max_abs_loss_diff": diffs[worst],
        "at_step": steps[worst],
        "max_rel_loss_diff": rel,
        "last_step_abs_loss_diff": diffs[-1],
    }
    print(
        f"loss curves, reduce-overhead vs default, {len(steps)} steps: max |diff| {diffs[worst]:.3e} at step "
        f"{steps[worst]} ({a[steps[worst]]:.5f} vs {b[steps[worst]]:.5f}), max relative {rel:.3e}, at the last "
        f"step {diffs[-1]:.3e}"
    )
(out / "comparison.json").write_text(json.dumps(comparison, indent=2) + "\n")
EOF
exit $failed
