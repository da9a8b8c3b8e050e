"""Shared test helpers. Everything that touches torch's global state runs in a fresh interpreter:
a stuck flag, a deadlock or a half-patched torch must not leak into other tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest
from packaging.version import Version

# Every fix (in the order they apply) and its self-test scenarios as the fix declares them (torchfix._fix.Scenario),
# evaluated for this torch, and torch's version: read in a fresh interpreter (importing torchfix here would patch
# torch in the test process).
_DECLARED = """
import json, torch
from torchfix import fixes
here = torch.__version__
found = [dict(name=fix.name, supported=fix.supports(here), cost=fix.hazard_is_cost) for fix in fixes.ALL]
scenarios = [
    dict(
        id=f"{fix.name}:{s.name}", fix=fix.name, call=s.call, function=s.function.__name__, hazard=here in s.hazard,
        shows=s.shows, needs=s.needs, crashes=s.crashes is not None and here in s.crashes,
        runs_without_fix=not s.needs_fix or fix.supports(here), stage=s.stage,
    )
    for fix in fixes.ALL for s in fix.scenarios
]
print(json.dumps({"torch": here, "fixes": found, "scenarios": scenarios}))
"""
_declared = json.loads(
    subprocess.run(
        [sys.executable, "-c", _DECLARED],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "TORCHFIX_DISABLE": "1"},
    ).stdout.splitlines()[-1]
)
TORCH_VERSION = Version(_declared["torch"])
FIXES: list[dict] = _declared["fixes"]
SCENARIOS: list[dict] = _declared["scenarios"]


def hazard_here(function: str) -> bool:
    """Whether this torch has the hazard that the declared scenario ``function`` shows."""
    return any(s["hazard"] for s in SCENARIOS if s["function"] == function)


# The first release no fix was checked against (the one after torchfix._fix.NEWEST_CHECKED; a test checks they
# agree). Not imported from torchfix, which would patch torch in the test process itself.
UNCHECKED = (2, 16)
HAS_H1 = hazard_here("h1_nested_trace_error")  # the FX tracing flag, a process global before torch 2.14
HAS_H3 = hazard_here("h3_is_compiling_elsewhere")  # torch.compiler._is_compiling_flag, set by every compile (2.13+)
HAS_H4 = hazard_here("h4_trace_patches_leak")  # Tracer.trace patches nn.Module process-wide, every release so far
# The H5 fix compiles backward graphs with their forward from 2.6 (torch's switch from 2.9, its eager
# path for dynamic shapes before).
HAS_H5_FIX = TORCH_VERSION.release >= (2, 6)
# Dynamo/Inductor config values are per-thread (ContextVar) from 2.12 (H6).
HAS_H6 = TORCH_VERSION.release >= (2, 12)
# Threads missing Dynamo's cache together each compile the frame again (2.6+ here); the fix needs 2.6+.
HAS_RECHECK_FIX = TORCH_VERSION.release >= (2, 6)
# Seen in the matrix: these releases segfault when a thread recompiles a frame that other threads wait to
# run, and without compile-cache-recheck (2.10: 3 of 3 runs) when they duplicate one frame's compile.
TORCH_CRASHES_ON_CONCURRENT_RECOMPILE = (2, 10) <= TORCH_VERSION.release < (2, 12)
# And when threads make_fx at once: FakeTensorMode.__enter__ calls torch._C._ensureCUDADeviceGuardSet() on a
# machine without CUDA, which segfaulted in 6 of 9 four-second soaks on 2.10, with torchfix and without (C++
# state, out of torchfix's reach). The make-fx-tracer fix declares those releases.
TORCH_CRASHES_ON_CONCURRENT_MAKE_FX = any(
    s["crashes"] for s in SCENARIOS if s["function"] == "make_fx_tracer_elsewhere"
)


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> object:
        """The last stdout line, parsed: scripts report their findings that way."""
        lines = self.stdout.strip().splitlines()
        assert lines, f"no output; stderr:\n{self.stderr}"
        return json.loads(lines[-1])


def run_python(
    code: str, *, disable: str | None = None, env: dict[str, str] | None = None, timeout: float = 180, args=()
) -> Ran:
    """Run ``code`` in a new interpreter. ``disable`` sets TORCHFIX_DISABLE (``"1"`` for all)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFIX_")}
    # Inductor forks its compile-worker pool when it is imported, which can be mid-run, from a compiling
    # thread. The scenarios never use those workers, and on a loaded 2-core machine a pool forked beside
    # live threads hung interpreter exit past the timeout (torch 2.3).
    full_env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    if disable is not None:
        full_env["TORCHFIX_DISABLE"] = disable
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )
    return Ran(proc.returncode, proc.stdout, proc.stderr)


def run_ok(code: str, **kwargs) -> Ran:
    ran = run_python(code, **kwargs)
    assert ran.returncode == 0, f"exit {ran.returncode}\nstdout:\n{ran.stdout}\nstderr:\n{ran.stderr}"
    return ran


@pytest.fixture(params=[False, True], ids=["torchfix", "disabled"])
def disabled(request) -> bool:
    """Run a hazard test twice: with torchfix, and with TORCHFIX_DISABLE=1 where the hazard must show."""
    return request.param
