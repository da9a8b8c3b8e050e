"""python -m bench [overhead] [coldstart] [firststep] [trainer] [cudagraphs] [cost] [equivalence] [instructions]
[--device DEV]
[--disable NAME,...] [--quick] [--out DIR]: print a table and write JSON per benchmark."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from . import coldstart, cost, cudagraphs, equivalence, firststep, instructions, overhead, trainer

BENCHMARKS = {
    "overhead": overhead,
    "coldstart": coldstart,
    "firststep": firststep,
    "trainer": trainer,
    "cudagraphs": cudagraphs,
    "cost": cost,
    "equivalence": equivalence,
    "instructions": instructions,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help=f"benchmarks to run: {', '.join(BENCHMARKS)} (default: all)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, not a measurement")
    parser.add_argument("--out", default="bench/results", help="where to write <name>.json")
    parser.add_argument(
        "--device",
        default="cpu",
        help="device for overhead (its CUDA-graph row), coldstart, firststep and trainer (cpu, cuda:0, ...)",
    )
    parser.add_argument(
        "--width", choices=("tiny", "real"), default="tiny", help="trainer: model width (see bench/trainer.py)"
    )
    parser.add_argument("--counts", default="1,2,3", help="trainer: drafter replica counts to run")
    parser.add_argument(
        "--runs", type=int, default=3, help="cudagraphs: runs per configuration; instructions: hash seeds per side"
    )
    parser.add_argument("--configs", default="", help="cudagraphs: indices of the configurations to run (0,1,...)")
    parser.add_argument("--parallel", type=int, default=1, help="cudagraphs: runs at once, each its own process")
    parser.add_argument(
        "--pairs",
        type=int,
        default=5,
        help="cost, firststep: ABBA pairs of runs, torchfix on and off (cost: 0 is none)",
    )
    parser.add_argument(
        "--fixes",
        nargs="?",
        const="",
        metavar="NAME,...",
        help="cost: also one run with each fix disabled in turn (those named, else every one the runs applied)",
    )
    parser.add_argument(
        "--disable",
        action="append",
        default=[],
        metavar="NAME[,NAME...]",
        help="overhead: one more process in the rows timed in turns, with TORCHFIX_DISABLE set to this (repeatable)",
    )
    parser.add_argument("--profile", action="store_true", help="cost: also profile a few steps each way, op by op")
    parser.add_argument(
        "--resume", action="store_true", help="cost: go on with the runs an interrupted run recorded in OUT/cost-state"
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)}: choose from {', '.join(BENCHMARKS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.names or list(BENCHMARKS):
        options = {"device": args.device} if name in ("overhead", "coldstart", "firststep", "trainer") else {}
        if name == "overhead":
            options |= {"disabled": args.disable}
        if name == "trainer":
            options |= {"width": args.width, "counts": tuple(int(n) for n in args.counts.split(","))}
        if name == "firststep":
            options |= {"pairs": args.pairs}
        if name == "instructions":
            options = {"runs": args.runs}
        if name == "cudagraphs":
            options = {"runs": args.runs, "configs": args.configs, "parallel": args.parallel}
        if name == "cost":
            state = out / "cost-state"
            if not args.resume:
                shutil.rmtree(state, ignore_errors=True)
            fixes = None if args.fixes is None else [name for name in args.fixes.split(",") if name]
            options = {"device": args.device, "pairs": args.pairs, "fixes": fixes, "profile": args.profile}
            options |= {"state": state}
        result = BENCHMARKS[name].run(quick=args.quick, **options)
        print(f"== {name}\n{BENCHMARKS[name].table(result)}")
        (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
