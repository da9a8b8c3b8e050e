"""A fork server for the tests (conftest.run_forked, conftest.fork_python): one interpreter imports torch (and the
modules named as its arguments), then forks a child per command line.

Most of a test interpreter's time is importing torch (about 2 of its CPU seconds), Dynamo, Inductor and export
(2-3 more), and for the trainer transformers and matplotlib; a child forked from here starts with those imported
and nothing else: torchfix is imported by the child itself, after them (an order torchfix supports; the
import-order tests start fresh interpreters instead). conftest starts this file's text with `python -c`, so that
sys.path is what a test's own `python -c` sees.

Forking is safe only from a single thread: the server runs no torch op (OpenMP and torch's pools start on the
first), keeps OpenBLAS (numpy, imported by torch) from starting its thread, and checks before every fork.

Protocol, one JSON line each way on stdin/stdout: {"argv", "env", "cwd", "timeout"} -> {"returncode", "stdout",
"stderr", "timed_out"}. The child runs `python *argv` (-c CODE, -m MODULE or a script, then its arguments: sys.argv,
sys.path[0] and `__main__` as python sets them) in the request's environment and folder, and ends with os._exit
(torch 2.3's teardown after threaded compiles can hang).
"""

import json
import os
import select
import signal
import sys
import tempfile
import threading
import traceback

STARTED_WITH = dict(os.environ)  # the children's environment is the request's, exactly
os.environ["OPENBLAS_NUM_THREADS"] = "1"  # read when numpy loads OpenBLAS, inside `import torch`
import importlib  # noqa: E402
import runpy  # noqa: E402

import torch  # noqa: E402, F401

for name in sys.argv[1:]:  # the modules to import besides (this torch may lack some)
    try:
        importlib.import_module(name)
    except ImportError:
        pass

# What the imports set for themselves (Inductor: TORCHINDUCTOR_CACHE_DIR): conftest decides whether a child has them,
# as a fresh interpreter would after its imports (a script that imports torch first), or not (`-m dflash_train`
# reads the environment before it imports torch).
SET_BY_IMPORTS = {k: v for k, v in os.environ.items() if k not in STARTED_WITH and k != "OPENBLAS_NUM_THREADS"}


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def run_python(argv: list[str]) -> None:
    """What `python *argv` runs, in this interpreter."""
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        main = sys.modules["__main__"] = type(sys)("__main__")
        exec(compile(argv[1], "<string>", "exec"), vars(main))
    elif argv[0] == "-m":
        sys.argv = ["-m", *argv[2:]]  # runpy puts the module's file first
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def run_child(argv: list[str], env: dict[str, str], cwd: str, out: int, err: int) -> None:
    """In the forked child: what `python *argv` does, then os._exit (never returns)."""
    os.setpgid(0, 0)  # its own process group: a timeout kills what it started too
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((devnull, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # PYTHONPATH is read at start: its entries go where python puts them, after sys.path[0] (set by run_python).
    sys.path[1:1] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    status = 0
    try:
        run_python(argv)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            status = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            status = 1
    except BaseException as exc:  # the traceback from the script's frames on, as python prints it
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code in (run_child.__code__, run_python.__code__):
            tb = tb.tb_next
        traceback.print_exception(exc.with_traceback(tb))
        status = 1
    threading._shutdown()  # wait for the script's threads, as interpreter exit does
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status)


def serve_one(request: dict) -> dict:
    if threads() != 1:
        raise RuntimeError(f"the fork server has {threads()} threads: forking it is not safe")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            run_child(request["argv"], request["env"], request["cwd"], out.fileno(), err.fileno())
        try:
            os.setpgid(pid, pid)  # as the child does: whichever runs first
        except OSError:
            pass
        exited = os.pidfd_open(pid)
        timed_out = not select.select([exited], [], [], request["timeout"])[0]
        if timed_out:
            os.killpg(pid, signal.SIGKILL)
        os.close(exited)
        _, status = os.waitpid(pid, 0)
        if not timed_out:
            try:  # what the child left running (a compile worker): nothing outlives its test
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out.seek(0)
        err.seek(0)
        return {
            "returncode": os.waitstatus_to_exitcode(status),
            "stdout": out.read().decode(errors="replace"),
            "stderr": err.read().decode(errors="replace"),
            "timed_out": timed_out,
        }


print(json.dumps({"ready": threads(), "env": STARTED_WITH, "set_by_imports": SET_BY_IMPORTS}), flush=True)
for line in sys.stdin:
    print(json.dumps(serve_one(json.loads(line))), flush=True)
