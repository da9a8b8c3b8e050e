"""python -m bench equivalence: one thread, torchfix on and off, the same corpus case by case.

torchfix promises that one thread sees torch exactly as without it. This runs torch's own OpInfo database (it ships
in the wheel: ``torch.testing._internal.common_methods_invocations.op_db``) twice, each in a fresh interpreter, with
torchfix and with ``TORCHFIX_DISABLE=1``, and compares per operator what a user can see: for its first sample input,
through ``torch.compile(backend="aot_eager")`` (the output, the graphs Dynamo made and their code, graph breaks,
recompiles, the error message) and through ``make_fx`` (the graph's code, the error). Then, the same way, each API a
fix patches used in one thread as torch's docs show it (``bench/equivalence_apis.py``: outputs, graph code, graph
breaks, recompiles, the guards and recompile reasons Dynamo logs, errors). Any difference is listed.
``--quick`` (what the test suite runs) takes every 25th operator and every API case.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# ``python -c CORPUS OUT STRIDE`` (a fresh interpreter) writes to OUT what every STRIDE-th operator of op_db showed.
CORPUS = r"""
import json, sys, warnings
import torchfix, torch
from torch._dynamo.utils import counters
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.common_methods_invocations import op_db
warnings.simplefilter("ignore")


def summary(value):
    if isinstance(value, torch.Tensor):
        exact = value.detach().to(torch.float64) if value.dtype.is_floating_point else value.detach()
        return [str(value.dtype), list(value.shape), repr(exact.sum().item()) if exact.numel() else "empty"]
    if isinstance(value, (list, tuple)):
        return [summary(v) for v in value]
    return repr(value)


def shapes(summarised):
    if isinstance(summarised, list) and len(summarised) == 3 and isinstance(summarised[1], list):
        return summarised[:2]
    return [shapes(s) for s in summarised] if isinstance(summarised, list) else summarised


def seeded(fn, *args, **kwargs):
    torch.manual_seed(0)
    return fn(*args, **kwargs)


def error(exc):
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def case(op):
    samples = op.sample_inputs("cpu", torch.float32, requires_grad=False)
    sample = next(iter(samples), None)
    if sample is None:
        return None
    args, kwargs = (sample.input, *sample.args), dict(sample.kwargs)
    found = {}
    torch._dynamo.reset()
    counters.clear()
    codes = []

    def backend(gm, example_inputs):
        codes.append(gm.code)
        from torch._dynamo.backends.debugging import aot_eager
        return aot_eager(gm, example_inputs)

    # An op whose values eager mode does not reproduce is compared by its outputs' dtypes and shapes only: the
    # empty* family returns uninitialised memory (by name: two calls can reuse one block), and any op whose two
    # eager calls, with other memory filled between them, differ.
    reproducible = "empty" not in op.name
    try:
        first = summary(seeded(op.op, *args, **kwargs))
        torch.full((1 << 16,), 7.0).add_(1)
        reproducible = reproducible and first == summary(seeded(op.op, *args, **kwargs))
    except Exception:
        pass
    try:
        out = seeded(torch.compile(lambda *a, **k: op.op(*a, **k), backend=backend), *args, **kwargs)
        found["compile"] = summary(out) if reproducible else shapes(summary(out))
    except Exception as exc:
        found["compile"] = error(exc)
    found["graphs"] = codes
    found["graph_breaks"] = sum(counters["graph_break"].values())
    found["recompiles"] = sum(counters["recompiles"].values())
    try:
        torch.manual_seed(0)
        found["make_fx"] = make_fx(lambda *a: op.op(*a, **kwargs))(*args).code
    except Exception as exc:
        found["make_fx"] = error(exc)
    return found


results = {}
for op in op_db[::int(sys.argv[2])]:
    name = f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name
    try:
        results[name] = case(op)
    except Exception as exc:  # the sample itself could not be made
        results[name] = {"sample": error(exc)}
with open(sys.argv[1], "w") as f:
    json.dump(results, f)
"""


def _observed(what: str, program: list[str], disable: bool, timeout: float) -> dict:
    """What ``python program[0] program[1] OUT program[2:]`` wrote to OUT (a JSON file), run in a fresh interpreter
    with torchfix, or with ``TORCHFIX_DISABLE=1``."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "results.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFIX_")}
        # One hash seed for both runs: some samples iterate a set of strings (meshgrid's indexing), whose order
        # differs between interpreters otherwise.
        env |= {"TORCHINDUCTOR_CACHE_DIR": folder, "TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTHONHASHSEED": "0"}
        if disable:
            env["TORCHFIX_DISABLE"] = "1"
        command = [sys.executable, *program[:2], str(out), *program[2:]]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"the {what} run failed ({'off' if disable else 'on'}):\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def _differences(what: str, program: list[str], timeout: float, prefix: str = "") -> tuple[dict, dict]:
    """Both runs of ``program``: what the run without torchfix saw, and each case that differs with torchfix."""
    with_fix, without = _observed(what, program, False, timeout), _observed(what, program, True, timeout)
    differ = {
        prefix + name: {"with torchfix": with_fix.get(name), "without": without.get(name)}
        for name in sorted(set(with_fix) | set(without))
        if with_fix.get(name) != without.get(name)
    }
    return without, differ


def run(quick: bool = False, every: int | None = None, timeout: float = 3600) -> dict:
    """Both runs and their differences, per operator."""
    every = every or (25 if quick else 1)
    without, differ = _differences("OpInfo corpus", ["-c", CORPUS, str(every)], timeout)
    apis, api_differ = _differences("API corpus", ["-m", "bench.equivalence_apis"], timeout, prefix="api: ")
    cases = [c for c in without.values() if c and "sample" not in c]
    return {
        "torch": importlib.metadata.version("torch"),
        "operators": len(without),
        "compiled": sum(1 for c in cases if not str(c.get("compile")).startswith(("Unsupported", "RuntimeError"))),
        "graphs": sum(len(c.get("graphs", [])) for c in cases),
        "api_cases": sorted(apis),
        "differences": differ | api_differ,
    }


def table(result: dict) -> str:
    lines = [
        f"operators: {result['operators']} (compiled: {result['compiled']}, graphs: {result['graphs']})",
        f"API cases: {len(result['api_cases'])} ({', '.join(result['api_cases'])})",
        f"differences with torchfix and without: {len(result['differences'])}",
    ]
    lines += [f"  {name}" for name in result["differences"]]
    return "\n".join(lines)
