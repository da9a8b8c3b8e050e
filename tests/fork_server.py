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
"stderr", "timed_out"} (or {"refused"}). The child runs `python *argv` (-c CODE, -m MODULE or a script, then its
arguments: sys.argv, sys.path[0] and `__main__` as python sets them) in the request's environment and folder, and ends
with os._exit (torch 2.3's teardown after threaded compiles can hang).

With `--socket PATH` first, the server instead forks for fork_client.py, a stand-in for `python` that a launcher such
as torchrun starts once per rank: the ranks run at the same time (they meet each other), each on its client's own
stdin, stdout and stderr (passed over the socket), and each client learns its child's pid and then its exit status.
A client that goes first (killed by its launcher) takes its child's process group with it. stdin's end stops it.
"""

import io
import json
import os
import select
import signal
import socket
import sys
import tempfile
import threading
import traceback

SOCKET = sys.argv[2] if sys.argv[1:2] == ["--socket"] else None
if SOCKET:
    del sys.argv[1:3]
STARTED_WITH = dict(os.environ)  # the children's environment is the request's, exactly
os.environ["OPENBLAS_NUM_THREADS"] = "1"  # read when numpy loads OpenBLAS, inside `import torch`
import importlib  # noqa: E402
import runpy  # noqa: E402

import torch  # noqa: E402

for name in sys.argv[1:]:  # the modules to import besides (this torch may lack some)
    try:
        importlib.import_module(name)
    except ImportError:
        pass

# What the imports set for themselves (Inductor: TORCHINDUCTOR_CACHE_DIR): conftest decides whether a child has them,
# as a fresh interpreter would after its imports (a script that imports torch first), or not (`-m dflash_train`
# reads the environment before it imports torch).
SET_BY_IMPORTS = {k: v for k, v in os.environ.items() if k not in STARTED_WITH and k != "OPENBLAS_NUM_THREADS"}

# What a request's environment may set otherwise than the server's: what the imports above never read. The tests'
# own variables, PYTHONPATH (the child puts it on sys.path), what the imports set for themselves, and what torchrun
# sets for a rank (its rendezvous and torchelastic's variables; OMP_NUM_THREADS is read by OpenMP when torch loads
# it: the child sets its threads from it, as a fresh start would).
MAY_DIFFER = (
    "TORCHFIX_", "PYTEST_", "PYTHONPATH", "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
    "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS",
)  # fmt: skip


def refused(env: dict[str, str]) -> str | None:
    """Why a child in ``env`` would not start as a fresh interpreter does, or None."""
    differs = {k for k in {*env, *STARTED_WITH} if env.get(k) != STARTED_WITH.get(k)} - set(SET_BY_IMPORTS)
    cannot = sorted(k for k in differs if not k.startswith(MAY_DIFFER))
    return f"a forked child cannot have {cannot} set otherwise than the fork server" if cannot else None


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


def unbuffered(stream: io.TextIOWrapper) -> io.TextIOWrapper:
    """``stream`` as python -u makes it: every write goes straight to its file descriptor."""
    raw = open(stream.fileno(), "wb", buffering=0, closefd=False)
    return io.TextIOWrapper(raw, encoding=stream.encoding, errors=stream.errors, write_through=True)


def run_child(request: dict, stdio: tuple[int, int, int]) -> None:
    """In the forked child: what `python *argv` does in the request's environment and folder, on the file descriptors
    ``stdio``, then os._exit (never returns). From fork_client.py, the request also says how its python was started
    (-u, SIGINT ignored), where the child stands in."""
    argv, env = request["argv"], request["env"]
    os.setpgid(0, 0)  # its own process group: a timeout kills what it started too
    if "sigint_ignored" in request:
        signal.signal(signal.SIGINT, signal.SIG_IGN if request["sigint_ignored"] else signal.default_int_handler)
    for fd, target in zip(stdio, (0, 1, 2)):
        os.dup2(fd, target)
    if request.get("unbuffered"):  # python -u, as torchrun starts its ranks: nothing written waits in a buffer
        sys.stdout, sys.stderr = (unbuffered(stream) for stream in (sys.stdout, sys.stderr))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(env)
    omp_threads = env.get("OMP_NUM_THREADS", "")
    if omp_threads != STARTED_WITH.get("OMP_NUM_THREADS", "") and omp_threads.isdigit():
        torch.set_num_threads(int(omp_threads))
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


def fork(request: dict, stdio: tuple[int, int, int], keep: tuple = ()) -> int:
    """Fork a child for ``request`` (closing in it the server's sockets ``keep``); its pid."""
    if threads() != 1:
        raise RuntimeError(f"the fork server has {threads()} threads: forking it is not safe")
    pid = os.fork()
    if pid == 0:
        for held in keep:
            held.close()
        run_child(request, stdio)
    try:
        os.setpgid(pid, pid)  # as the child does: whichever runs first
    except OSError:
        pass
    return pid


def kill_leftovers(pid: int) -> None:
    """What the child left running in its process group (a compile worker): nothing outlives its test."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def serve_one(request: dict) -> dict:
    why_not = refused(request["env"])
    if why_not:
        return {"refused": why_not}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull) as devnull:
        pid = fork(request, (devnull.fileno(), out.fileno(), err.fileno()))
        exited = os.pidfd_open(pid)
        timed_out = not select.select([exited], [], [], request["timeout"])[0]
        if timed_out:
            os.killpg(pid, signal.SIGKILL)
        os.close(exited)
        _, status = os.waitpid(pid, 0)
        if not timed_out:
            kill_leftovers(pid)
        out.seek(0)
        err.seek(0)
        return {
            "returncode": os.waitstatus_to_exitcode(status),
            "stdout": out.read().decode(errors="replace"),
            "stderr": err.read().decode(errors="replace"),
            "timed_out": timed_out,
        }


def tell(conn: socket.socket, **message: object) -> None:
    try:
        conn.send(json.dumps(message).encode())
    except OSError:  # the client is gone
        pass


def serve_clients(path: str) -> None:
    """The socket mode: children for fork_client.py's connections, side by side, until stdin ends."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen()
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, the client's connection)
    clients: dict[socket.socket, int] = {}  # connection -> its child's pid
    print(READY, flush=True)
    while True:
        for ready in select.select([sys.stdin, listener, *children, *clients], [], [])[0]:
            if ready is sys.stdin:
                if not sys.stdin.readline():
                    for pid in clients.values():
                        kill_leftovers(pid)
                    return
            elif ready is listener:
                conn, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                request = json.loads(message) if message and len(fds) == 3 else None
                why_not = refused(request["env"]) if request else "no request (the client ended?)"
                if why_not:
                    tell(conn, refused=why_not)
                    conn.close()
                else:
                    pid = fork(request, tuple(fds), keep=(listener, conn, *clients))
                    children[os.pidfd_open(pid)] = pid, conn
                    clients[conn] = pid
                    tell(conn, pid=pid)
                for fd in fds:
                    os.close(fd)
            elif ready in children:  # a child ended: its client exits as it did
                pid, conn = children.pop(ready)
                os.close(ready)
                _, status = os.waitpid(pid, 0)
                kill_leftovers(pid)
                if clients.pop(conn, None) is not None:
                    tell(conn, returncode=os.waitstatus_to_exitcode(status))
                conn.close()
            elif ready in clients:  # a client went first: its launcher killed it, and would have killed the child
                kill_leftovers(clients.pop(ready))


READY = json.dumps({"ready": threads(), "set_by_imports": SET_BY_IMPORTS})
if SOCKET:
    serve_clients(SOCKET)
else:
    print(READY, flush=True)
    for line in sys.stdin:
        print(json.dumps(serve_one(json.loads(line))), flush=True)
