"""python -m bench equivalence: one thread, torchfix on and off, the same corpus case by case.

torchfix promises that one thread sees torch exactly as without it. This runs torch's own OpInfo database (it ships
in the wheel: ``torch.testing._internal.common_methods_invocations.op_db``) twice, each in a fresh interpreter, with
torchfix and with ``TORCHFIX_DISABLE=1``, and compares per operator what a user can see: for its first sample input,
through ``torch.compile(backend="aot_eager")`` (the output, the graphs Dynamo made and their code, graph breaks,
recompiles, the error message) and through ``make_fx`` (the graph's code, the error). Any difference is listed.
``--quick`` (what the test suite runs) takes every 25th operator.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# Run in a fresh interpreter: ``{every}`` is the stride through op_db, ``{out}`` the JSON file to write.
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
for op in op_db[::{every}]:
    name = f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name
    try:
        results[name] = case(op)
    except Exception as exc:  # the sample itself could not be made
        results[name] = {"sample": error(exc)}
with open({out!r}, "w") as f:
    json.dump(results, f)
"""


def _corpus(every: int, disable: bool, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "results.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFIX_")}
        # One hash seed for both runs: some samples iterate a set of strings (meshgrid's indexing), whose order
        # differs between interpreters otherwise.
        env |= {"TORCHINDUCTOR_CACHE_DIR": folder, "TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTHONHASHSEED": "0"}
        if disable:
            env["TORCHFIX_DISABLE"] = "1"
        code = CORPUS.replace("{every}", str(every)).replace("{out!r}", repr(str(out)))
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"the corpus run failed ({'off' if disable else 'on'}):\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def run(quick: bool = False, every: int | None = None, timeout: float = 3600) -> dict:
    """Both runs and their differences, per operator."""
    every = every or (25 if quick else 1)
    with_fix, without = _corpus(every, disable=False, timeout=timeout), _corpus(every, disable=True, timeout=timeout)
    differ = {
        name: {"with torchfix": with_fix.get(name), "without": without.get(name)}
        for name in sorted(set(with_fix) | set(without))
        if with_fix.get(name) != without.get(name)
    }
    cases = [c for c in without.values() if c and "sample" not in c]
    return {
        "torch": importlib.metadata.version("torch"),
        "operators": len(without),
        "compiled": sum(1 for c in cases if not str(c.get("compile")).startswith(("Unsupported", "RuntimeError"))),
        "graphs": sum(len(c.get("graphs", [])) for c in cases),
        "differences": differ,
    }


def table(result: dict) -> str:
    lines = [
        f"operators: {result['operators']} (compiled: {result['compiled']}, graphs: {result['graphs']})",
        f"differences with torchfix and without: {len(result['differences'])}",
    ]
    lines += [f"  {name}" for name in result["differences"]]
    return "\n".join(lines)
