"""python -m bench equivalence: one thread, torchfix on and off, the same corpus case by case.

torchfix promises that one thread sees torch exactly as without it. This runs torch's own OpInfo database (it ships
in the wheel: ``torch.testing._internal.common_methods_invocations.op_db``) twice, in two children forked from one
interpreter that imported it (never torchfix): one imports torchfix, the other never does. It compares per operator
what a user can see: for its first sample input, through ``torch.compile(backend="aot_eager")`` (the output, the
graphs Dynamo made and their code, graph breaks, recompiles, the error message) and through ``make_fx`` (the graph's
code, the error). Then, the same way, each API a
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

# ``python -c CORPUS OUT STRIDE`` writes to OUT what every STRIDE-th operator of op_db showed (run by SIDES).
CORPUS = r"""
import json, sys, warnings
import torch
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


# ``python -c SIDES FOLDER PRELOAD CODE ARGS...``: a fresh interpreter imports PRELOAD (the corpus's imports: OpInfo's
# database takes ~20 CPU s), never torchfix, then forks a child per side, one after the other, each running CODE as
# ``python -c CODE FOLDER/SIDE.json ARGS...`` would: "on" imports torchfix first, "off" never imports it. Both start
# from the same interpreter state (the random generators' too). KERNELS_SHARED: the off side's Inductor cache starts
# with the C++ kernels the on side compiled. Inductor files a kernel under a hash of its source, which each side
# generates itself: a kernel that differs is compiled again, and only the C++ compiler's work is saved (~10 CPU s of
# the suite's run). The graph caches are not shared: a hit there would skip the compile the sides are compared on.
SIDES = r"""
import importlib, os, shutil, sys, traceback
folder, preload, code, *args = sys.argv[1:]
importlib.import_module(preload)
if "torchfix" in sys.modules:
    sys.exit("torchfix was imported before the fork: the off side would have it")
if len(os.listdir("/proc/self/task")) != 1:
    sys.exit("the imports started threads: forking is safe from one thread only")
for side in ("on", "off"):
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            # Each side its own compile caches, as two separate runs (but KERNELS_SHARED).
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ["TRITON_CACHE_DIR"] = os.path.join(folder, side)
            if side == "on":
                import torchfix  # noqa: F401
            sys.argv = ["-c", os.path.join(folder, side + ".json"), *args]
            exec(compile(code, "<corpus>", "exec"), {"__name__": "__main__"})
            status = 0 if side == "on" or "torchfix" not in sys.modules else 2
            if status:
                print("the off side imported torchfix", file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:  # os._exit: the children share the parent's buffers and at-exit handlers
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    if status:
        sys.exit(f"the {side} side failed (exit {os.waitstatus_to_exitcode(status)})")
    if side == "on":  # KERNELS_SHARED
        done = os.path.join(folder, "on")
        for name in os.listdir(done) if os.path.isdir(done) else ():
            if len(name) == 2:  # the kernels' folders, named by two characters of a hash; not fxgraph/, aotautograd/
                shutil.copytree(os.path.join(done, name), os.path.join(folder, "off", name))
"""


# What only the side with torchfix of the API corpus reports, beside its cases: the fixes whose patched code each case
# ran (measured: bench/equivalence_apis.py's main). Not compared.
FIXES_RUN = "fixes run"


def _differences(what: str, preload: str, code: str, args: list[str], timeout: float, prefix: str = "") -> tuple:
    """Both sides of a corpus (SIDES): what the side without torchfix saw, what only the side with it reports
    (``FIXES_RUN``), and each case that differs between them."""
    with tempfile.TemporaryDirectory() as folder:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFIX_")}
        # One hash seed (some samples iterate a set of strings: meshgrid's indexing), one compile thread, and
        # OpenBLAS (loaded with numpy, by torch) without its threads, which would make forking unsafe.
        env |= {"PYTHONHASHSEED": "0", "TORCHINDUCTOR_COMPILE_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        command = [sys.executable, "-c", SIDES, folder, preload, code, *args]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=2 * timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"the {what} run failed:\n{proc.stderr[-3000:]}")
        with_fix, without = (json.loads((Path(folder) / f"{side}.json").read_text()) for side in ("on", "off"))
    reported = with_fix.pop(FIXES_RUN, {})
    differ = {
        prefix + name: {"with torchfix": with_fix.get(name), "without": without.get(name)}
        for name in sorted(set(with_fix) | set(without))
        if with_fix.get(name) != without.get(name)
    }
    return without, reported, differ


def _triggers() -> list[str]:
    """The parts of torch that fixes wait for (``Fix.trigger``), read in an interpreter of its own: this one may import
    torch for another benchmark, which torchfix would then patch."""
    code = "from torchfix import fixes\nprint(*sorted({entry.trigger for entry in fixes.ROSTER}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()


def run(quick: bool = False, every: int | None = None, timeout: float = 3600) -> dict:
    """Both runs and their differences, per operator."""
    every = every or (25 if quick else 1)
    ops = "torch.testing._internal.common_methods_invocations"
    without, _, differ = _differences("OpInfo corpus", ops, CORPUS, [str(every)], timeout)
    apis_main = "import sys\nfrom bench.equivalence_apis import main\nmain(sys.argv[1], sys.argv[2:])"
    apis, fixes_run, api_differ = _differences(
        "API corpus", "bench.equivalence_apis", apis_main, _triggers(), timeout, prefix="api: "
    )
    cases = [c for c in without.values() if c and "sample" not in c]
    return {
        "torch": importlib.metadata.version("torch"),
        "operators": len(without),
        "compiled": sum(1 for c in cases if not str(c.get("compile")).startswith(("Unsupported", "RuntimeError"))),
        "graphs": sum(len(c.get("graphs", [])) for c in cases),
        "api_cases": sorted(apis),
        # per case, the fixes whose patched code it ran; and the fixes applied here that have any
        "api_fixes_run": fixes_run.get("cases", {}),
        "fixes_with_patched_code": fixes_run.get("fixes with patched code", []),
        "differences": differ | api_differ,
    }


def table(result: dict) -> str:
    lines = [
        f"operators: {result['operators']} (compiled: {result['compiled']}, graphs: {result['graphs']})",
        f"API cases: {len(result['api_cases'])} ({', '.join(result['api_cases'])})",
        f"differences with torchfix and without: {len(result['differences'])}",
    ]
    ran = {name for names in result["api_fixes_run"].values() for name in names}
    with_code = result["fixes_with_patched_code"]
    not_run = ", ".join(sorted(set(with_code) - ran)) or "none"
    lines.insert(2, f"fixes whose patched code the API cases ran: {len(ran)} of {len(with_code)} (not run: {not_run})")
    lines += [f"  {name}" for name in result["differences"]]
    return "\n".join(lines)
