"""What torchfix costs: compiled-call rate and flag-read time with and without it, measured side by
side in one process (alternating blocks, torchfix uninstalled and reinstalled between them, and a control block
without it), the time ``import torchfix`` adds (fresh interpreters), and in three worker processes taking turns (one
with torchfix and two that never import it, whose ratio is the row's noise floor) an eager backward's rate and on CUDA
the replay rate of a ``reduce-overhead`` compiled module, with the calls of a step counted (on Python 3.12+ in every
thread, with its bytecode instructions); ``--disable`` adds a process with some fixes disabled, to place a cost.

Goal: every rate with torchfix / without >= 0.995; ``import torchfix`` after torch <= 50 ms.
"""

from __future__ import annotations

import compileall
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path


def _rate(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return calls / (time.perf_counter() - start)


def side_by_side(fn: Callable[[], object], calls: int, rounds: int) -> dict[str, float]:
    """Calls per second with and without torchfix: many short blocks in turn (ABCCBA order, so none always runs
    first), and the median over rounds of each round's ratio with its quartiles. Short blocks keep a drift of the
    machine (clock, other load) from landing on one side only. A third block, uninstalled like the second, is the
    control: its ratio to the second is what two identical blocks differ by here (the row's noise floor)."""
    import torchfix

    installed = {"with": True, "without": False, "control": False}
    rates: dict[str, list[float]] = {label: [] for label in installed}
    for round_no in range(rounds):
        for label in list(installed) if round_no % 2 == 0 else list(reversed(installed)):
            torchfix.install() if installed[label] else torchfix.uninstall()
            fn()  # the first call after a swap runs new bytecode unspecialised
            rates[label].append(_rate(fn, calls))
    torchfix.install()
    return _ratios(rates)


def _ratios(rates: dict[str, list[float]]) -> dict[str, float]:
    """The rates' medians, the median of the rounds' ratios with its quartiles, and the same for the control; and
    the ratio of each side's fastest block ("best"): noise only ever slows a block down, so the fastest blocks are
    the closest to the work itself."""
    with_fix, without_fix, control = rates["with"], rates["without"], rates["control"]
    ratios = [a / b for a, b in zip(with_fix, without_fix)]
    controls = [c / b for c, b in zip(control, without_fix)]
    quartiles, control_quartiles = statistics.quantiles(ratios, n=4), statistics.quantiles(controls, n=4)
    return {
        "with_torchfix_per_s": statistics.median(with_fix),
        "without_torchfix_per_s": statistics.median(without_fix),
        "ratio": statistics.median(ratios),
        "ratio_q1": quartiles[0],
        "ratio_q3": quartiles[2],
        "control_ratio": statistics.median(controls),
        "control_ratio_q1": control_quartiles[0],
        "control_ratio_q3": control_quartiles[2],
        "best_ratio": max(with_fix) / max(without_fix),
        "control_best_ratio": max(control) / max(without_fix),
    }


def work_per_call(fn: Callable[[], object]) -> dict[str, int]:
    """Bytecode instructions executed and Python/C functions called by one ``fn()``, with and without
    torchfix: the work it adds, counted exactly, where the timed ratio is only as steady as the machine."""
    import torchfix

    def count(installed: bool) -> tuple[int, int]:
        torchfix.install() if installed else torchfix.uninstall()
        fn()  # warm: the first call after a swap may take paths later calls do not
        opcodes = calls = 0

        def trace(frame: types.FrameType, event: str, arg: object) -> Callable[..., object]:
            nonlocal opcodes
            frame.f_trace_opcodes = True
            opcodes += event == "opcode"
            return trace

        def profile(frame: types.FrameType, event: str, arg: object) -> None:
            nonlocal calls
            calls += event in ("call", "c_call")

        # Python 3.12 turns opcode events on when sys.settrace is called, and only once some frame has asked for
        # them: without this line the first count of a process read 0.
        sys._getframe().f_trace_opcodes = True
        sys.settrace(trace)
        try:
            fn()
        finally:
            sys.settrace(None)
        sys.setprofile(profile)
        try:
            fn()
        finally:
            sys.setprofile(None)
        return opcodes, calls

    (opcodes_without, calls_without), (opcodes_with, calls_with) = count(False), count(True)
    return {
        "opcodes_with_torchfix": opcodes_with,
        "opcodes_without_torchfix": opcodes_without,
        "calls_with_torchfix": calls_with,
        "calls_without_torchfix": calls_without,
    }


# The workers of the rows timed in separate processes (``processes_in_turns``): ``python -c WORKER TORCHFIX CPU ...``
# runs pinned to that one CPU, imports torchfix first where TORCHFIX is "1", prints "ready" with the calls and the
# bytecode instructions of one step (counted, whatever the load; -1 where not counted) and, as JSON, its instructions
# by function, then for each line of stdin (a number of steps) the steps per second and the main thread's CPU
# seconds a step (what the rate leaves out: time the step waits).
TURNS_HEAD = r"""
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[2])})
if sys.argv[1] == "1":
    import torchfix
import torch
"""
TURNS_TAIL = r"""
import collections, json
calls, by_code = 0, collections.Counter()  # by_code: bytecode instructions by code object (Python 3.12+)
if hasattr(sys, "monitoring"):  # Python 3.12+: in every thread (a CUDA backward runs in autograd's own)
    def on_call(code, offset, callee, arg0):
        global calls
        calls += 1
    def on_instruction(code, offset):
        by_code[code] += 1
    monitoring = sys.monitoring
    tool, events = monitoring.PROFILER_ID, monitoring.events
    monitoring.use_tool_id(tool, "bench")
    monitoring.register_callback(tool, events.CALL, on_call)
    monitoring.register_callback(tool, events.INSTRUCTION, on_instruction)
    monitoring.set_events(tool, events.CALL | events.INSTRUCTION)
    for _ in range(20):
        step()
    sync()
    monitoring.set_events(tool, 0)
    monitoring.free_tool_id(tool)
else:  # the calls of this thread only (no count of instructions)
    def count(frame, event, arg):
        global calls
        calls += event in ("call", "c_call")
    sys.setprofile(count)
    for _ in range(20):
        step()
    sys.setprofile(None)
    sync()
def function(code):  # a name both processes give it: Inductor's output files are named by hashes of their own
    path = code.co_filename
    if path.startswith(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or "\0"):
        path = "<Inductor's output>"
    return f"{path.rpartition('site-packages/')[2]}:{code.co_qualname}"
by_function = collections.Counter()
for code, executed in by_code.items():
    by_function[function(code)] += executed / 20
instructions = sum(by_function.values()) if by_code else -1
print("ready", calls / 20, instructions, json.dumps(by_function), flush=True)
for line in sys.stdin:
    steps = int(line)
    sync()
    start, cpu = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        step()
    sync()
    print(steps / (time.perf_counter() - start), (time.thread_time() - cpu) / steps, flush=True)
"""


def in_turns_worker(step_code: str) -> str:
    """A worker for ``processes_in_turns``: ``step_code`` defines ``step()`` and ``sync()`` (and may warm up)."""
    return TURNS_HEAD + step_code + TURNS_TAIL


# One thread replaying a reduce-overhead compiled module's forward and backward (argv[3]: the CUDA device).
REPLAY_WORKER = in_turns_worker(r"""
device = sys.argv[3]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).to(device)
x = torch.randn(64, 256, device=device)
compiled = torch.compile(model, mode="reduce-overhead")
sync = torch.cuda.synchronize
def step():
    torch.compiler.cudagraph_mark_step_begin()
    compiled(x).square().mean().backward()
    model.zero_grad(set_to_none=True)  # the gradients are the graph's outputs: the next replay reuses their memory
for _ in range(20):  # compile, warm up, record the forward and backward graphs, replay
    step()
""")

# An eager forward and backward of 22 autograd nodes, after one compiled training step (which makes torchfix's
# per-thread state): autograd copies torch's C++ thread-local stash in and out at every node, and from torch 2.13
# torchfix keeps that state there.
BACKWARD_WORKER = in_turns_worker(r"""
torch.set_num_threads(1)
torch.compile(torch.nn.Linear(4, 4), backend="aot_eager")(torch.ones(2, 4)).sum().backward()
w = torch.randn(16, requires_grad=True)
sync = lambda: None
def step():
    y = w
    for _ in range(20):
        y = y * 1.0001
    y.sum().backward()
""")


def processes_in_turns(
    worker: str, args: list[str], steps: int, rounds: int, disabled: Sequence[str] = (), sets: int = 1
) -> dict[str, object]:
    """Steps per second of ``worker`` with torchfix and without (a process that never imports it), in turns (ABBA);
    the median of the rounds' ratios with quartiles. A second process without torchfix runs in the same turns as a
    control: its ratio to the first is what two identical processes differ by on this machine (the noise floor of
    the row). Each value of ``disabled`` adds a process with torchfix and ``TORCHFIX_DISABLE`` set to it, to place
    a cost found. Only one process runs at a time; the others wait on their pipes, and all run on one CPU: left to
    the scheduler, each process landed on other cores and the control was several times as wide (docs/measured.md,
    "Pinned to one core"). Each process compiles into Inductor and Triton caches of its own, empty: with shared ones,
    whichever process compiled first would leave the others loading its results, a path of their own.

    ``sets``: that many sets of processes, one after another, their rounds pooled, and each set's ratios reported:
    two identical processes can differ by more than torchfix's cost (docs/measured.md, "The replay, set by set")."""
    variants = {"with": {}, "without": None, "control": None}  # label -> TORCHFIX_ variables, or None: no torchfix
    variants |= {f"disabled {value}": {"TORCHFIX_DISABLE": value} for value in disabled}
    rates: dict[str, list[float]] = {label: [] for label in variants}
    cpu_per_step: dict[str, list[float]] = {label: [] for label in variants}
    set_ratios, set_controls = [], []
    for _ in range(sets):
        try:
            counted, set_rates, set_cpu = _one_set(worker, args, steps, rounds, variants)
        except RuntimeError as exc:
            return {"failed": str(exc)}
        for label in variants:
            rates[label] += set_rates[label]
            cpu_per_step[label] += set_cpu[label]
        set_ratios.append(statistics.median(a / b for a, b in zip(set_rates["with"], set_rates["without"])))
        set_controls.append(statistics.median(c / b for c, b in zip(set_rates["control"], set_rates["without"])))
    calls_per_step = {label: calls for label, (calls, _, _) in counted.items()}
    instructions_per_step = {label: instructions for label, (_, instructions, _) in counted.items()}
    return {
        **_ratios(rates),
        "set_ratios": set_ratios,
        "set_control_ratios": set_controls,
        "calls_per_step_with_torchfix": calls_per_step["with"],
        "calls_per_step_without_torchfix": calls_per_step["without"],
        "instructions_per_step_with_torchfix": instructions_per_step["with"],
        "instructions_per_step_without_torchfix": instructions_per_step["without"],
        "counted_in": "every thread" if instructions_per_step["with"] is not None else "the main thread",
        "added_by_function": added_by_function(counted["with"][2], counted["without"][2]),
        "cpu_us_per_step": {label: 1e6 * statistics.median(seconds) for label, seconds in cpu_per_step.items()},
        "disabled": {
            label: {
                "ratio": statistics.median(a / b for a, b in zip(rates[label], rates["without"])),
                "calls_per_step": calls_per_step[label],
                "instructions_per_step": instructions_per_step[label],
            }
            for label in variants
            if label.startswith("disabled ")
        },
        "sets": sets,
        "rounds": rounds,
        "steps_per_block": steps,
    }


def added_by_function(with_fix: dict[str, float], without: dict[str, float], most: int = 15) -> dict[str, float]:
    """Where the bytecode instructions a step with torchfix differs from one without, by function (``file:qualname``),
    the largest differences first (at most ``most``; none under half an instruction a step)."""
    differences = {name: with_fix.get(name, 0) - without.get(name, 0) for name in with_fix.keys() | without.keys()}
    largest = sorted(differences.items(), key=lambda item: -abs(item[1]))[:most]
    return {name: difference for name, difference in largest if abs(difference) >= 0.5}


def _one_set(
    worker: str, args: list[str], steps: int, rounds: int, variants: dict[str, dict[str, str] | None]
) -> tuple[dict[str, tuple[float, float | None, dict[str, float]]], dict[str, list[float]], dict[str, list[float]]]:
    """One set of ``processes_in_turns``: each process's calls and bytecode instructions a step (None: not counted,
    Python < 3.12) and its instructions a step by function, and per label the rounds' rates and main-thread CPU
    seconds a step."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFIX_")}
    cpu = str(max(os.sched_getaffinity(0)))
    caches = tempfile.TemporaryDirectory(prefix="bench-in-turns-")
    workers = {}
    for number, (label, variables) in enumerate(variants.items()):
        cache = Path(caches.name, str(number))
        workers[label] = subprocess.Popen(
            [sys.executable, "-c", worker, "0" if variables is None else "1", cpu, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env
            | (variables or {})
            | {"TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton")},
        )
    try:
        counted = {}
        for label, proc in workers.items():
            ready = proc.stdout.readline().split(maxsplit=3)
            if ready[:1] != ["ready"]:
                raise RuntimeError(f"the worker {label} did not start")
            _, calls, instructions, by_function = ready
            instructions = None if instructions == "-1" else float(instructions)
            counted[label] = (float(calls), instructions, json.loads(by_function))
        rates: dict[str, list[float]] = {label: [] for label in workers}
        cpu_per_step: dict[str, list[float]] = {label: [] for label in workers}
        for round_no in range(rounds):
            for label in list(workers) if round_no % 2 == 0 else list(reversed(workers)):
                proc = workers[label]
                proc.stdin.write(f"{steps}\n")
                proc.stdin.flush()
                rate, cpu_seconds = map(float, proc.stdout.readline().split())
                rates[label].append(rate)
                cpu_per_step[label].append(cpu_seconds)
    finally:
        for proc in workers.values():
            proc.stdin.close()
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
        caches.cleanup()
    return counted, rates, cpu_per_step


def cudagraph_replay(
    device: str, steps: int, rounds: int, disabled: Sequence[str] = (), sets: int = 1
) -> dict[str, object]:
    """``processes_in_turns`` of one thread replaying a ``reduce-overhead`` compiled module's forward and backward."""
    if not device.startswith("cuda"):
        return {"skipped": f"CUDA graphs need a CUDA device (--device cuda:0); this run's is {device}"}
    return processes_in_turns(REPLAY_WORKER, [device], steps, rounds, disabled, sets)


def eager_backward(steps: int, rounds: int, disabled: Sequence[str] = (), sets: int = 1) -> dict[str, object]:
    """``processes_in_turns`` of an eager forward and backward of 22 autograd nodes, on the CPU."""
    return processes_in_turns(BACKWARD_WORKER, [], steps, rounds, disabled, sets)


def _import_seconds(code: str, repeats: int, **env: str) -> list[float]:
    times = []
    for _ in range(repeats):
        environ = {**os.environ, **env}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=environ)
        times.append(float(out.stdout))
    return times


def _median_ms(code: str, repeats: int, **env: str) -> float:
    return 1e3 * statistics.median(_import_seconds(code, repeats, **env))


def import_cost(repeats: int) -> dict[str, float]:
    """Medians over ``repeats`` fresh interpreters (and, for ``import torchfix`` after torch with its cache, the
    quartiles). The first run with the cache on fills it (unless an earlier one did), so its median is a warm
    start's."""
    # torchfix's own bytecode compiled first, as pip's install does: a machine with PYTHONDONTWRITEBYTECODE set (the
    # GPU machine) would otherwise compile its modules from source in every interpreter.
    compileall.compile_dir(str(Path(__file__).resolve().parent.parent / "torchfix"), quiet=1)
    timed = "import time; t = time.perf_counter(); {body}; print(time.perf_counter() - t)"
    after_torch = "import torch; " + timed.format(body="import torchfix")
    warm = [1e3 * seconds for seconds in _import_seconds(after_torch, repeats)]
    quartiles = statistics.quantiles(warm, n=4) if len(warm) > 1 else warm * 3
    return {
        "import_torchfix_after_torch_ms": statistics.median(warm),
        "import_torchfix_after_torch_q1_ms": quartiles[0],
        "import_torchfix_after_torch_q3_ms": quartiles[2],
        "import_runs": repeats,
        "import_torchfix_after_torch_uncached_ms": _median_ms(after_torch, repeats, TORCHFIX_CACHE="0"),
        "import_torchfix_after_torch_disabled_ms": _median_ms(after_torch, repeats, TORCHFIX_DISABLE="1"),
        "import_torch_ms": _median_ms(timed.format(body="import torch"), repeats),
        "import_torchfix_then_torch_ms": _median_ms(timed.format(body="import torchfix, torch"), repeats),
    }


def run(quick: bool = False, device: str = "cpu", disabled: Sequence[str] = ()) -> dict[str, object]:
    """Every row; ``disabled``: values of ``TORCHFIX_DISABLE``, each an extra process in the rows timed in turns."""
    import torch
    import torch.fx._symbolic_trace as st

    import torchfix

    calls, rounds = (200, 4) if quick else (2000, 201)
    steps, sets = (20, 1) if quick else (500, 3)  # of the rows timed in turns: steps a block, sets of processes
    x = torch.ones(4)
    compiled = torch.compile(lambda t: t + 1, backend="eager")
    compiled(x)
    # A compiled module's call does more than a function's (OptimizedModule.__call__ sets a flag around it).
    compiled_module = torch.compile(torch.nn.Linear(4, 4), backend="eager")
    compiled_module(x)
    predicate = getattr(st, "is_fx_symbolic_tracing", None) or st.is_fx_tracing
    result: dict[str, object] = {
        "torch": str(torch.__version__),
        "fixes": {s.name: s.state.value for s in torchfix.status()},
        "compiled_call": side_by_side(lambda: compiled(x), calls, rounds),
        "compiled_call_work": work_per_call(lambda: compiled(x)),
        "compiled_module_call": side_by_side(lambda: compiled_module(x), calls, rounds),
        "compiled_module_call_work": work_per_call(lambda: compiled_module(x)),
        "flag_read": side_by_side(predicate, calls * 10, rounds),
        "cudagraph_replay": cudagraph_replay(device, steps, 4 if quick else 41, disabled, sets),
        "eager_backward": eager_backward(steps, 2 if quick else 41, disabled, sets),
    }
    result.update(import_cost(repeats=1 if quick else 15))
    return result


def table(result: dict) -> str:
    lines = [f"torch {result['torch']}, fixes {result['fixes']}"]
    for key in ("compiled_call", "compiled_module_call", "flag_read", "cudagraph_replay", "eager_backward"):
        r = result.get(key, {"skipped": "not measured"})
        if "with_torchfix_per_s" not in r:
            lines.append(f"{key:<20} {r.get('skipped') or r.get('failed')}")
            continue
        lines.append(
            f"{key:<20} with {r['with_torchfix_per_s']:>12,.0f}/s  without {r['without_torchfix_per_s']:>12,.0f}/s"
            f"  ratio {r['ratio']:.4f} (quartiles {r['ratio_q1']:.3f} - {r['ratio_q3']:.3f})"
            + (
                f"; control (without torchfix twice): {r['control_ratio']:.4f} "
                f"({r['control_ratio_q1']:.3f} - {r['control_ratio_q3']:.3f}); fastest blocks: "
                f"{r['best_ratio']:.4f}, control {r['control_best_ratio']:.4f}"
            )
            + (
                f"; calls a step {r['calls_per_step_with_torchfix']:.0f} with, "
                f"{r['calls_per_step_without_torchfix']:.0f} without"
                + (
                    f", bytecode instructions {r['instructions_per_step_with_torchfix']:.0f} with, "
                    f"{r['instructions_per_step_without_torchfix']:.0f} without"
                    if r["instructions_per_step_with_torchfix"] is not None
                    else ""
                )
                + f" ({r['counted_in']})"
                if "calls_per_step_with_torchfix" in r
                else ""
            )
            + (
                f"; each set of processes: {', '.join(f'{ratio:.4f}' for ratio in r['set_ratios'])} (controls "
                f"{', '.join(f'{ratio:.4f}' for ratio in r['set_control_ratios'])})"
                if r.get("sets", 1) > 1
                else ""
            )
        )
        for label, cpu_us in r.get("cpu_us_per_step", {}).items():
            variant = r["disabled"].get(label)
            lines.append(
                f"  {label:<18} main thread's CPU {cpu_us:8.1f} us a step"
                + (f"; ratio {variant['ratio']:.4f}, calls a step {variant['calls_per_step']:.0f}" if variant else "")
                + (
                    f", instructions {variant['instructions_per_step']:.0f}"
                    if variant and variant["instructions_per_step"] is not None
                    else ""
                )
            )
        added = r.get("added_by_function", {})
        lines += ["  bytecode instructions a step with torchfix less without, by function:"] if added else []
        lines += [f"    {difference:+8.1f}  {name}" for name, difference in added.items()]
    for what, key in (("compiled call", "compiled_call_work"), ("compiled module call", "compiled_module_call_work")):
        work = result[key]
        lines.append(
            f"one {what} executes {work['opcodes_with_torchfix']} bytecode instructions and "
            f"{work['calls_with_torchfix']} calls with torchfix, {work['opcodes_without_torchfix']} and "
            f"{work['calls_without_torchfix']} without"
        )
    lines += [
        f"import torchfix (torch already imported): {result['import_torchfix_after_torch_ms']:.1f} ms, median of "
        f"{result['import_runs']} fresh interpreters (quartiles {result['import_torchfix_after_torch_q1_ms']:.1f} - "
        f"{result['import_torchfix_after_torch_q3_ms']:.1f}) "
        f"(without its cache {result['import_torchfix_after_torch_uncached_ms']:.0f} ms; with every fix disabled "
        f"{result['import_torchfix_after_torch_disabled_ms']:.1f} ms)",
        f"import torch: {result['import_torch_ms']:.0f} ms; "
        f"import torchfix, torch: {result['import_torchfix_then_torch_ms']:.0f} ms",
    ]
    return "\n".join(lines)
