"""Shared test helpers. Everything that touches torch's global state runs in an interpreter of its own (a fresh
one, or a child of a fork server that has imported torch, or torch and what the trainer imports, and never
torchfix): a stuck flag, a deadlock or a half-patched torch must not leak into other tests."""

from __future__ import annotations

import atexit
import compileall
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.version import Version

# OpenMP's passive wait for every process of the suite, as the trainer sets for itself: with a pytest worker per
# core, the OpenMP threads of one worker's torch spinning between ops took the cores from the other's (a tiny
# in-process training used 3-10x the CPU seconds). This process's too (some tests train in it): read by libgomp
# when torch is imported, after this file. Scheduling only: no result depends on it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parent.parent


def pytest_configure(config: pytest.Config) -> None:
    # The project's bytecode, compiled once before the workers start, as pip compiles an installed package's: an
    # editable install has none, and where PYTHONDONTWRITEBYTECODE is set (this machine, CI's) every one of the
    # suite's several hundred interpreters compiled torchfix, dflash_train and the benchmarks from source.
    if not hasattr(config, "workerinput"):  # pytest-xdist's controller, or a run without workers
        for package in ("torchfix", "dflash_train", "bench", "tests"):
            compileall.compile_dir(REPO / package, quiet=1)


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


def _test_env(disable: str | None = None, env: dict[str, str] | None = None) -> dict[str, str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFIX_")}
    # Inductor forks its compile-worker pool when it is imported, which can be mid-run, from a compiling
    # thread. The scenarios never use those workers, and on a loaded 2-core machine a pool forked beside
    # live threads hung interpreter exit past the timeout (torch 2.3).
    full_env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    if disable is not None:
        full_env["TORCHFIX_DISABLE"] = disable
    full_env.update(env or {})
    return full_env


def run_python(
    code: str,
    *,
    forked: str | None = None,
    disable: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 180,
    args=(),
) -> Ran:
    """Run ``code`` in a new interpreter, or forked (``run_forked``) from one that has imported torch
    (``forked="torch"``) or torch and every module a fix waits for (``forked="triggers"``: the fixes all apply at
    ``import torchfix``). ``disable`` sets TORCHFIX_DISABLE (``"1"`` for all)."""
    if forked is not None:
        preload = {"torch": (), "triggers": TRIGGERS}[forked]
        return run_forked(code, preload=preload, disable=disable, env=env, timeout=timeout, args=args)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        env=_test_env(disable, env),
        timeout=timeout,
    )
    return Ran(proc.returncode, proc.stdout, proc.stderr)


class _ForkServer:
    """A fork server (tests/fork_server.py) of this test process, started at its first use: one per set of modules
    it imports before forking, and per mode (``socket``: for fork_client.py, tests/fork_server.py's socket mode)."""

    source = (Path(__file__).parent / "fork_server.py").read_text()
    running: dict[tuple[tuple[str, ...], bool], _ForkServer] = {}

    def __init__(self, preload: tuple[str, ...], socket: bool) -> None:
        self.folder = tempfile.TemporaryDirectory(prefix="fork-server-") if socket else None  # the socket's
        self.socket = str(Path(self.folder.name) / "socket") if socket else None
        mode = ["--socket", self.socket] if socket else []
        self.process = subprocess.Popen(
            [sys.executable, "-c", self.source, *mode, *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=_test_env(),
        )
        atexit.register(self.stop)
        ready = json.loads(self.process.stdout.readline())
        assert ready["ready"] == 1, f"the fork server started with {ready['ready']} threads"
        self.set_by_imports: dict[str, str] = ready["set_by_imports"]

    @classmethod
    def get(cls, preload: tuple[str, ...], socket: bool = False) -> _ForkServer:
        server = cls.running.get((preload, socket))
        if server is None or server.process.poll() is not None:
            server = cls.running[preload, socket] = cls(preload, socket)
        return server

    def request(self, **request) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        reply = self.process.stdout.readline()
        assert reply, f"the fork server died (exit {self.process.wait()})"
        reply = json.loads(reply)
        assert "refused" not in reply, reply["refused"]
        return reply

    def stop(self) -> None:
        self.process.stdin.close()  # the server ends at the end of its input
        self.process.wait(60)
        if self.folder is not None:
            self.folder.cleanup()


def fork_python(
    argv: list[str], *, preload: tuple[str, ...], env: dict[str, str], cwd: str | None = None, timeout: float = 180
) -> Ran:
    """``python *argv`` (``-c CODE``, ``-m MODULE`` or a script, then its arguments) in ``env`` exactly and ``cwd``
    (this process's by default), as ``subprocess.run`` would run it, but in a child forked from an interpreter
    that has imported torch and the ``preload`` modules (never torchfix, never the project's own modules): for
    code that imports torchfix itself and does not test what happens before those are imported, nor the
    interpreter's start or exit. Saves the imports' CPU seconds every run (torch ~2, Dynamo, Inductor and
    export ~2-3 more, transformers and matplotlib ~1). The environment may differ from the server's only where
    the imports do not read it (fork_server.MAY_DIFFER: the server refuses the rest)."""
    server = _ForkServer.get(preload)
    reply = server.request(argv=list(argv), env=env, cwd=cwd or os.getcwd(), timeout=timeout)
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired(["<forked>", *argv], timeout, reply["stdout"], reply["stderr"])
    return Ran(reply["returncode"], reply["stdout"], reply["stderr"])


def forked_python(preload: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """What a launcher (torchrun) can start in place of ``python`` so that each process it starts is forked from an
    interpreter that has imported torch and the ``preload`` modules (tests/fork_client.py, run by ``python``; for
    the same code as ``fork_python``), and the variable that leads the client to that server."""
    server = _ForkServer.get(preload, socket=True)
    return [str(Path(__file__).parent / "fork_client.py")], {"FORK_SERVER_SOCKET": server.socket}


def run_forked(
    code: str,
    *,
    preload: tuple[str, ...] = (),
    disable: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 180,
    args=(),
) -> Ran:
    """``run_python``, forked (``fork_python``) from an interpreter that has imported torch and the ``preload``
    modules of torch. The code starts with what those imports set in the environment (TORCHINDUCTOR_CACHE_DIR),
    as it would have after importing them in a fresh interpreter."""
    server = _ForkServer.get(preload)
    full_env = {**server.set_by_imports, **_test_env(disable, env)}
    return fork_python(["-c", textwrap.dedent(code), *args], preload=preload, env=full_env, timeout=timeout)


def torchfix_cli(*args: str, forked: str | None = "triggers", **kwargs) -> Ran:
    """``python -m torchfix ARGS`` (``run_python``), forked from an interpreter that has imported what the commands
    import (torch and the triggers) unless ``forked`` says otherwise (``None``: a fresh interpreter)."""
    code = "import sys, torchfix.__main__ as m; sys.exit(m.main(sys.argv[1:]))"
    return run_python(code, args=args, forked=forked, **kwargs)


def run_ok(code: str, **kwargs) -> Ran:
    """``run_python``, asserting that ``code`` exits 0."""
    ran = run_python(code, **kwargs)
    assert ran.returncode == 0, f"exit {ran.returncode}\nstdout:\n{ran.stdout}\nstderr:\n{ran.stderr}"
    return ran


def run_scenario(code: str, **kwargs) -> object:
    """What a scenario script reports (``Ran.json``), run forked with every trigger imported. One that reports
    null (what it needs is missing: a CUDA device, or a part of torch not imported yet) runs again in a fresh
    interpreter before the test skips it."""
    return run_ok(code, forked="triggers", **kwargs).json() or run_ok(code, **kwargs).json()


# Every fix (in the order they apply) and its self-test scenarios as the fix declares them (torchfix._fix.Scenario),
# evaluated for this torch, and torch's version: read in a fresh interpreter (importing torchfix here would patch
# torch in the test process).
_DECLARED = """
import json, torch
from torchfix import fixes
here = torch.__version__
found = [
    dict(
        name=fix.name, supported=fix.supports(here), versions=str(fix.versions),
        releases=[fix.versions.first, fix.versions.last], cost=fix.hazard_is_cost, survey_rows=fix.survey_rows,
        needs_cuda=fix.needs_cuda,
    )
    for fix in fixes.ALL
]
triggers = sorted({fix.trigger for fix in fixes.ALL})
scenarios = [
    dict(
        id=f"{fix.name}:{s.name}", fix=fix.name, call=s.call, function=s.function.__name__, hazard=here in s.hazard,
        shows=s.shows, needs=s.needs, crashes=s.crashes is not None and here in s.crashes,
        runs_without_fix=not s.needs_fix or fix.supports(here), stage=s.stage,
    )
    for fix in fixes.ALL for s in fix.scenarios
]
print(json.dumps({"torch": here, "fixes": found, "scenarios": scenarios, "triggers": triggers}))
"""
# Read once per run: pytest-xdist's workers start after the controller has imported this file, and inherit its
# environment (a variable tests strip from their interpreters' with the other TORCHFIX_ ones), for this interpreter.
_DECLARED_IN_ENV = "TORCHFIX_TESTS_DECLARED"
_declared = json.loads(os.environ.get(_DECLARED_IN_ENV, "{}"))
if _declared.get("python") != sys.executable:
    _declared = run_ok(_DECLARED, disable="1").json() | {"python": sys.executable}
    os.environ[_DECLARED_IN_ENV] = json.dumps(_declared)
TORCH_VERSION = Version(_declared["torch"])
FIXES: list[dict] = _declared["fixes"]

# The survey of torch's process state (docs/torch-N.M-globals.md) and the release it read, (N, M).
SURVEY = next((Path(__file__).resolve().parent.parent / "docs").glob("torch-*-globals.md"))
SURVEYED = tuple(int(part) for part in SURVEY.name.split("-")[1].split(".")[:2])
SCENARIOS: list[dict] = _declared["scenarios"]
TRIGGERS: tuple[str, ...] = tuple(_declared["triggers"])  # the parts of torch that fixes wait for


def hazard_here(function: str) -> bool:
    """Whether this torch has the hazard that the declared scenario ``function`` shows."""
    return any(s["hazard"] for s in SCENARIOS if s["function"] == function)


def fix_here(name: str) -> dict:
    """The fix ``name`` as declared, evaluated for this torch (``supported``: this torch is one of its ``versions``)."""
    return next(fix for fix in FIXES if fix["name"] == name)


def needs_fix(name: str) -> pytest.MarkDecorator:
    """Skip a test of the fix ``name`` where this torch is not one of its releases."""
    fix = fix_here(name)
    return pytest.mark.skipif(not fix["supported"], reason=f"{name} patches torch {fix['versions']} only")


def crashes_here(function: str) -> bool:
    """Whether torch itself can crash in the declared scenario ``function`` on this torch (``Scenario.crashes``)."""
    return any(s["crashes"] for s in SCENARIOS if s["function"] == function)


# What the tests know of torch's releases, read from the fixes' declarations (test_torchfix_cli checks that no
# release is written here by hand but in HAS_H6, below, with its reason).
HAS_H1 = hazard_here("h1_nested_trace_error")  # the FX tracing flag, a process global before torch 2.14
HAS_H3 = hazard_here("h3_is_compiling_elsewhere")  # torch.compiler._is_compiling_flag, set by every compile (2.13+)
HAS_H4 = hazard_here("h4_trace_patches_leak")  # Tracer.trace patches nn.Module process-wide, every release so far
# The H5 fix compiles backward graphs with their forward (torch's switch from 2.9, its eager path for dynamic
# shapes before).
HAS_H5_FIX = fix_here("backward-compile-deadlock")["supported"]
# The releases that segfault when a thread recompiles a frame that other threads wait to run, and without
# compile-cache-recheck when they duplicate one frame's compile: its scenario declares them.
TORCH_CRASHES_ON_CONCURRENT_RECOMPILE = crashes_here("duplicate_compiles")
# And when threads make_fx at once: FakeTensorMode.__enter__ calls torch._C._ensureCUDADeviceGuardSet() on a
# machine without CUDA, which segfaulted in 6 of 9 four-second soaks on 2.10, with torchfix and without (C++
# state, out of torchfix's reach). The make-fx-tracer fix declares those releases.
TORCH_CRASHES_ON_CONCURRENT_MAKE_FX = crashes_here("make_fx_tracer_elsewhere")
# Dynamo/Inductor config values are per-thread (ContextVar) from 2.12 (H6). By hand: no fix declares it
# (propagate_config is an API, not a fix), and its test checks torchfix's own reading of it against this.
HAS_H6 = TORCH_VERSION.release >= (2, 12)


@pytest.fixture(params=[False, True], ids=["torchfix", "disabled"])
def disabled(request) -> bool:
    """Run a hazard test twice: with torchfix, and with TORCHFIX_DISABLE=1 where the hazard must show."""
    return request.param
