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

TORCH_VERSION = Version(
    subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True, check=True
    ).stdout.strip()
)
# The first release no fix was checked against (the one after torchfix._fix.NEWEST_CHECKED; a test checks they
# agree): the hazards of the newest checked release are taken as present up to it. Not imported from torchfix:
# importing it here would patch torch in the test process itself.
UNCHECKED = (2, 16)
# The FX tracing flag is a process global before torch 2.14 (H1); _set_compilation_env exists from 2.2 (H2).
HAS_H1 = TORCH_VERSION.release < (2, 14)
HAS_H2 = (2, 2) <= TORCH_VERSION.release < (2, 14)
# Every Dynamo compile sets torch.compiler._is_compiling_flag, still a process global, from 2.13 (H3).
HAS_H3 = (2, 13) <= TORCH_VERSION.release < UNCHECKED
# Tracer.trace patches nn.Module and wrapped functions process-wide in every release so far (H4).
HAS_H4 = TORCH_VERSION.release < UNCHECKED
# The H5 fix compiles backward graphs with their forward from 2.6 (torch's switch from 2.9, its eager
# path for dynamic shapes before).
HAS_H5_FIX = TORCH_VERSION.release >= (2, 6)
# Dynamo 2.2 keeps the backends its guards look up (eval_frame's cached_backends) per thread, so code compiled in
# one thread fails its guard with KeyError in another that compiled it again; 2.1 guards no backend, 2.3 shares them.
HAS_PER_THREAD_GUARDED_BACKENDS = TORCH_VERSION.release[:2] == (2, 2)
# torch._ops.get_cached_ops() (2.1+) hands out the live process-wide set, which pre-dispatch mode pushes iterate.
HAS_CACHED_OPS = (2, 1) <= TORCH_VERSION.release < UNCHECKED
# Dynamo/Inductor config values are per-thread (ContextVar) from 2.12 (H6).
HAS_H6 = TORCH_VERSION.release >= (2, 12)
# torch.export._trace's _EXPORT_MODULE_HIERARCHY (2.4+; _EXPORT_FLAGS, only for logs, from 2.3): globals to 2.15.
HAS_EXPORT_TRACE = (2, 4) <= TORCH_VERSION.release < UNCHECKED
# torch._library's global_ctx_getter, what torch.library.get_ctx() returns (2.2+): a process global to 2.15; the
# scenario's custom operator needs torch.library.custom_op (2.4+).
HAS_FAKE_IMPL_CTX = (2, 4) <= TORCH_VERSION.release < UNCHECKED
# Non-strict export patches builtins.max/min for the process while it traces (2.8+), in every release so far.
HAS_EXPORT_BUILTINS = (2, 8) <= TORCH_VERSION.release < UNCHECKED
# proxy_tensor's _CURRENT_MAKE_FX_TRACER, the make_fx trace in progress (2.4+): a process global to 2.15.
HAS_MAKE_FX_TRACER = (2, 4) <= TORCH_VERSION.release < UNCHECKED
# torch.export.save registers its FakeTensor reducer in the process-wide copyreg table (2.3+); the scenario's
# held save pickles the example inputs, which save writes from 2.4.
HAS_EXPORT_SAVE = (2, 4) <= TORCH_VERSION.release < UNCHECKED
# torch._ops' pre-dispatch mode stack (2.3+) is one for the process to 2.15; torch.export.export pushes onto it
# from 2.4 (2.3 exports without pre-dispatch tracing: only make_fx(pre_dispatch=True) uses the stack there).
HAS_PRE_DISPATCH_MODES = (2, 4) <= TORCH_VERSION.release < UNCHECKED
# CUDA graph trees (2.1+): the tree containers exist only in the importing thread before 2.13; the
# mark-step counter and the generation are process globals in every release so far (H7).
HAS_H7_TREES = (2, 1) <= TORCH_VERSION.release < (2, 13)
# A thread's trees stay in torch's C++ thread-local stash past its end in every release with trees (on
# 2.1 - 2.12 a thread has none of its own without the fix, which the same scenario reports as the hazard).
HAS_H7_TREES_AT_END = (2, 1) <= TORCH_VERSION.release < UNCHECKED
HAS_H7_COUNTERS = (2, 1) <= TORCH_VERSION.release < UNCHECKED
# torch.fx.traceback's node metadata is process-global in every release so far (upstream #184917).
HAS_NODE_META = TORCH_VERSION.release < UNCHECKED
# torch.export.load keeps the deserializer at work in a process global from 2.3 (upstream #195099).
HAS_EXPORT_LOAD = (2, 3) <= TORCH_VERSION.release < UNCHECKED
# torch.compiler.set_stance (2.6+) keeps the stance in a process global in every release so far.
HAS_STANCE = (2, 6) <= TORCH_VERSION.release < UNCHECKED
# Threads missing Dynamo's cache together each compile the frame again (2.6+ here); the fix needs 2.6+.
HAS_RECHECK_FIX = TORCH_VERSION.release >= (2, 6)
# Seen in the matrix: these releases segfault when a thread recompiles a frame that other threads wait to
# run, and without compile-cache-recheck (2.10: 3 of 3 runs) when they duplicate one frame's compile.
TORCH_CRASHES_ON_CONCURRENT_RECOMPILE = (2, 10) <= TORCH_VERSION.release < (2, 12)
# And when threads make_fx at once (and when one make_fx trace ends while another thread's is open):
# FakeTensorMode.__enter__ calls torch._C._ensureCUDADeviceGuardSet() on a
# machine without CUDA, which segfaulted in 6 of 9 four-second soaks on 2.10, with torchfix and without (C++
# state, out of torchfix's reach); 2.11 has the same code and was not run; 2.13 did not crash.
TORCH_CRASHES_ON_CONCURRENT_MAKE_FX = (2, 10) <= TORCH_VERSION.release < (2, 12)


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
