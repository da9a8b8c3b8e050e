"""``python -m torchfix stress``: a randomized soak of threads using torch's compile, trace and export paths at
once, on the user's own torch build, with torchfix on and with it off.

Worker threads repeat random actions and check every result: ``symbolic_trace`` and ``make_fx`` of small
functions, an eager ``torch.cond`` (a higher-order op: it enters ``_set_compilation_env``), calls of
functions compiled with ``aot_eager`` (and inductor), fresh compiles, ``torch.export`` with a save/load
round trip, compiled calls inside ``set_stance("force_eager")``, node-meta recording and the code of one shared graph
written again (what threads' first calls of one compiled graph do). The main thread
does none of it: it samples each fix's leak probe, and each sample showing another thread's state is a leak.
Once the workers stop, every probe must find its state back at its default (a stuck flag). What the soak does and
looks for about one fix's hazard is that fix's declaration (``Fix.soak``: the actions whose check is of it, the
texts that name it in an error, its leak probe), and the report counts it under the fix's name.

Each run is a fresh interpreter (``--child``); the parent runs torchfix on, then off (``TORCHFIX_DISABLE=1``),
with the same seed, and prints errors, leaked samples and stuck state per hazard side by side. Each run first does
every action once in its main thread (the first compiles: seconds each while Inductor's caches are cold, and the
run that meets them first fills them for the next) and only then starts its timed window, and counts the actions
that end inside it: a short run's counts are the soak's, not its first compiles' (``--no-warm-up`` leaves those in
the window).
"""

from __future__ import annotations

import argparse
import faulthandler
import io
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable

from .. import fixes
from .._fix import SoakAction
from . import scenarios


def _add_one(x):
    return x + 1


def _times_two(x):
    return x * 2


# The soak's own actions: torch's entry points, whose runs at once make the fixes' hazards show (each checks its
# result, and counts a failure under the hazard whose declared text its message has). The actions whose own check
# is of one fix's hazard are that fix's (``Fix.soak``).


def _make_fx() -> Callable[[random.Random], None]:
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    def trace(rng: random.Random) -> None:
        graph = make_fx(_times_two)(torch.ones(2))
        targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
        assert targets == ["aten.mul.Tensor"], f"make_fx graph {targets}"

    return trace


def _eager_cond() -> Callable[[random.Random], None] | None:
    """A higher-order op called eagerly: it enters ``_set_compilation_env``."""
    import torch

    if not hasattr(torch, "cond"):
        return None

    def cond(rng: random.Random) -> None:
        x = torch.full((2,), float(rng.randint(-3, 3)))
        out = torch.cond(x.sum() > 0, lambda v: v + 1, lambda v: v - 1, (x,))
        assert torch.equal(out, x + 1 if x.sum() > 0 else x - 1), "torch.cond gave a wrong result"

    return cond


def _compiled_call() -> Callable[[random.Random], None]:
    import torch

    compiled, graph_runs = scenarios.counting_compile(_add_one, "aot_eager")

    def call(rng: random.Random) -> None:
        before = graph_runs()
        x = torch.full((2,), float(rng.randint(0, 9)))
        assert torch.equal(compiled(x), x + 1), "compiled call gave a wrong result"
        assert graph_runs() == before + 1, "a compiled call ran uncompiled"

    return call


def _fresh_compile() -> Callable[[random.Random], None]:
    import torch

    def compile_and_call(rng: random.Random) -> None:
        k = rng.randint(2, 9)
        fn = torch.compile(lambda x: x * k - 1, backend="aot_eager")
        x = torch.ones(3)
        assert torch.equal(fn(x), x * k - 1), "fresh compile gave a wrong result"

    return compile_and_call


def _export() -> Callable[[random.Random], None] | None:
    """``torch.export`` with a save/load round trip."""
    import torch

    if not hasattr(getattr(torch, "export", None), "load"):
        return None

    def export(rng: random.Random) -> None:
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(rng.randint(0, 99)))
        program = torch.export.export(torch.nn.Linear(3, 3), (x,))
        buffer = io.BytesIO()
        torch.export.save(program, buffer)
        loaded = torch.export.load(io.BytesIO(buffer.getvalue()))
        assert torch.allclose(loaded.module()(x), program.module()(x)), "export load gave another program"

    return export


def _inductor_call() -> Callable[[random.Random], None]:
    import torch

    compiled = torch.compile(_times_two)

    def call(rng: random.Random) -> None:
        x = torch.full((4,), float(rng.randint(0, 9)))
        assert torch.equal(compiled(x), x * 2), "inductor call gave a wrong result"

    return call


INDUCTOR_CALL = "inductor call"  # left out by --no-inductor
OWN_ACTIONS = (
    SoakAction("make_fx", 3, _make_fx),
    SoakAction("eager cond", 2, _eager_cond),
    SoakAction("compiled call", 6, _compiled_call),
    SoakAction("fresh compile", 1, _fresh_compile),
    SoakAction("export", 1, _export),
    SoakAction(INDUCTOR_CALL, 2, _inductor_call),
)
# Every action (the menu; --actions names them): the soak's own, then the fixes' in the order they apply.
ACTIONS: list[SoakAction] = [*OWN_ACTIONS, *(action for fix in fixes.ALL if fix.soak for action in fix.soak.actions)]
# What an error message says about its hazard, by the fix's name; anything else is reported as "other". A compiled
# call that ran eagerly is what several fixes' hazards do to it: counted apart.
ERROR_HAZARDS = [(text, fix.name) for fix in fixes.ALL if fix.soak for text in fix.soak.errors]
ERROR_HAZARDS.append(("ran uncompiled", "compiled call ran eagerly"))


class Soak:
    """The actions, the checks and the counts of one run (one interpreter)."""

    def __init__(self, seed: int, inductor: bool, actions: list[str] | None = None) -> None:
        self.seed = seed
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.actions: Counter[str] = Counter()
        self.errors: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self.leaks: defaultdict[str, list[int]] = defaultdict(lambda: [0, 0])  # hazard -> [leaked, samples]
        # What the main thread samples, per fix: made first, before any action has run.
        self.leak_probes = {fix.name: fix.soak.leak_probe() for fix in fixes.ALL if fix.soak and fix.soak.leak_probe}
        chosen = [
            action
            for action in ACTIONS
            if action.name in (actions or [action.name]) and (inductor or action.name != INDUCTOR_CALL)
        ]
        made = [(action.name, action.make(), action.weight) for action in chosen]
        self.menu = [(name, act, weight) for name, act, weight in made if act is not None]

    # --- the threads ---------------------------------------------------------------------------------

    def _act(self, name: str, action: Callable[[random.Random], None], rng: random.Random) -> None:
        try:
            action(rng)
        except Exception as exc:
            first_line = (str(exc).strip().splitlines() or [""])[0]
            message = f"{name}: {type(exc).__name__}: {first_line[:160]}"
            hazard = next((h for text, h in ERROR_HAZARDS if text in str(exc)), "other")
            with self.lock:
                self.errors[hazard][message] += 1

    def warm_up(self) -> float:
        """Each action once before the timed window: the first compiles (seconds each with Inductor's caches cold)
        and the first export's imports, which would otherwise fill a short window and count for the run that meets
        them first. In a thread of its own: what the main thread sees is what other threads leave (``flags``), and
        some of torch's own state outlives an action in the thread that ran it (torch 2.2's node meta). Returns
        the seconds it took."""

        def each_once() -> None:
            rng = random.Random(self.seed)
            for name, action, _weight in self.menu:
                self._act(name, action, rng)

        start = time.monotonic()
        thread = threading.Thread(target=each_once, name="stress-warm-up", daemon=True)
        thread.start()
        thread.join()
        return time.monotonic() - start

    def worker(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        names, fns, weights = zip(*self.menu)
        while not self.stop.is_set():
            pick = rng.choices(range(len(fns)), weights)[0]
            self._act(names[pick], fns[pick], rng)
            with self.lock:  # an action that ends after the window is not the window's
                if time.monotonic() <= self.deadline:
                    self.actions[names[pick]] += 1
                else:
                    self.after_window += 1

    def flags(self, at_end: bool = False) -> dict[str, bool]:
        """Per hazard: whether this (the main) thread sees state that only another thread can have set; ``at_end``
        (no action runs any more): whether state is left set."""
        return {hazard: leaked(at_end) for hazard, leaked in self.leak_probes.items()}

    def run(self, seconds: float, threads: int, warm_up: bool = True) -> dict[str, object]:
        warm_up_s = self.warm_up() if warm_up else 0.0
        workers = [
            threading.Thread(target=self.worker, args=(i,), name=f"stress-{i}", daemon=True) for i in range(threads)
        ]
        self.deadline, self.after_window = time.monotonic() + seconds, 0
        for thread in workers:
            thread.start()
        while time.monotonic() < self.deadline:
            for hazard, leaked in self.flags().items():
                counts = self.leaks[hazard]
                counts[0] += leaked
                counts[1] += 1
            time.sleep(0.0005)
        self.stop.set()
        for thread in workers:
            thread.join(120)
        hung = [thread.name for thread in workers if thread.is_alive()]
        stuck = [hazard for hazard, set_ in self.flags(at_end=True).items() if set_]
        return {
            "warm_up_s": round(warm_up_s, 2),
            "after_window": self.after_window,
            "actions": dict(self.actions),
            "errors": {hazard: dict(messages) for hazard, messages in self.errors.items()},
            "leaks": {hazard: counts for hazard, counts in self.leaks.items()},
            "stuck": stuck,
            "hung": hung,
        }


def child(
    seconds: float, threads: int, seed: int, inductor: bool, actions: list[str] | None, warm_up: bool = True
) -> int:
    faulthandler.enable()  # a crash inside torch prints every thread's stack
    faulthandler.dump_traceback_later(seconds + 600, exit=True)  # so does a deadlock, and ends the run
    import torch

    import torchfix

    soak = Soak(seed, inductor, actions)
    report = soak.run(seconds, threads, warm_up)
    report.update(
        torch=str(torch.__version__),
        torchfix_disable=os.environ.get("TORCHFIX_DISABLE", ""),
        fixes=[f"{entry.name}: {entry.state.value}" for entry in torchfix.status()],
    )
    print(json.dumps(report), flush=True)
    return 0


def _run_child(args: argparse.Namespace, disable: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFIX_")}
    if disable:
        env["TORCHFIX_DISABLE"] = disable
    command = [sys.executable, "-m", "torchfix", "stress", "--child", f"--seconds={args.seconds}"]
    command += [f"--threads={args.threads}", f"--seed={args.seed}"] + ([] if args.inductor else ["--no-inductor"])
    command += [f"--actions={args.actions}"] if args.actions else []
    command += [] if args.warm_up else ["--no-warm-up"]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.seconds + 900)
    except subprocess.TimeoutExpired:
        return {"failed": "killed: no answer 15 minutes after the soak's end"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        if proc.returncode < 0:  # a crash inside torch: faulthandler printed every thread's stack
            # From faulthandler's report on: the crashing thread's stack comes first, the others after it.
            start = proc.stderr.rfind("Fatal Python error")
            return {
                "failed": f"crashed: killed by {signal.Signals(-proc.returncode).name}",
                "stderr": proc.stderr[start:][:8000] if start >= 0 else proc.stderr[-4000:],
            }
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"failed": f"exit {proc.returncode}: {tail[:300]}"}
    return json.loads(lines[-1])


def problems(report: dict[str, object]) -> int:
    """Errors, leaked samples, stuck flags and hung threads of one run."""
    if "failed" in report:
        return 1
    errors = sum(sum(messages.values()) for messages in report["errors"].values())
    leaks = sum(leaked for leaked, _samples in report["leaks"].values())
    return errors + leaks + len(report["stuck"]) + len(report["hung"])


def table(runs: dict[str, dict[str, object]]) -> str:
    lines = []
    for label, report in runs.items():
        lines.append(f"torchfix {label}:")
        if "failed" in report:
            lines.append(f"  run failed: {report['failed']}")
            continue
        total = sum(report["actions"].values())
        lines.append(
            f"  torch {report['torch']}; {total} actions in the window: "
            + ", ".join(f"{k} {v}" for k, v in sorted(report["actions"].items()))
        )
        warm_up = f"warm-up before it {report['warm_up_s']:.1f} s (each action once: the first compiles)"
        lines.append(
            f"  {warm_up if report['warm_up_s'] else 'no warm-up: the first compiles are in the window'}; "
            f"{report['after_window']} actions ended after it, not counted"
        )
        hazards = sorted({*report["leaks"], *report["errors"], *report["stuck"]})
        for hazard in hazards:
            leaked, samples = report["leaks"].get(hazard, [0, 0])
            errors = report["errors"].get(hazard, {})
            stuck = "STUCK at the end" if hazard in report["stuck"] else "back to default"
            lines.append(
                f"  {hazard:<26} errors {sum(errors.values()):>5}  leaked {leaked:>6} of {samples} samples  {stuck}"
            )
            lines += [
                f"      {count} x {message}" for message, count in sorted(errors.items(), key=lambda kv: -kv[1])[:3]
            ]
        if report["hung"]:
            lines.append(f"  HUNG: {', '.join(report['hung'])}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if args.seconds <= 0 or args.threads < 1:
        print("stress: --seconds must be positive and --threads at least 1", file=sys.stderr)
        return 2
    actions = [name.strip() for name in args.actions.split(",") if name.strip()] if args.actions else None
    names = [action.name for action in ACTIONS]
    unknown = sorted(set(actions or []) - set(names))
    if unknown:
        print(f"stress: unknown action(s) {', '.join(unknown)}; the actions: {', '.join(names)}", file=sys.stderr)
        return 2
    if args.child:
        return child(args.seconds, args.threads, args.seed, args.inductor, actions, args.warm_up)
    modes = {"on": "", "off": "1"}
    chosen = modes if args.torchfix == "both" else {args.torchfix: modes[args.torchfix]}
    runs = {label: _run_child(args, disable) for label, disable in chosen.items()}
    print(json.dumps(runs) if args.json else table(runs))
    return 1 if "on" in runs and problems(runs["on"]) else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=60.0, help="how long each run soaks (default 60)")
    parser.add_argument("--threads", type=int, default=4, help="worker threads (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="the random choice of actions (default 0)")
    parser.add_argument("--no-inductor", dest="inductor", action="store_false", help="leave inductor compiles out")
    parser.add_argument("--torchfix", choices=("both", "on", "off"), default="both", help="which runs (default both)")
    parser.add_argument(
        "--actions",
        default="",
        help=f"comma-separated, the workers' actions (default all): {', '.join(action.name for action in ACTIONS)}",
    )
    parser.add_argument(
        "--no-warm-up",
        dest="warm_up",
        action="store_false",
        help="start the window cold: the first compiles (and their races) count in it",
    )
    parser.add_argument("--json", action="store_true", help="print the reports as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one run, in this interpreter
