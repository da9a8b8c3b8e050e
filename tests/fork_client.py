"""``python fork_client.py ARGS`` runs ``python ARGS`` forked from the fork server (tests/fork_server.py, socket mode)
whose socket FORK_SERVER_SOCKET names: what a launcher (torchrun) starts in place of a rank's fresh interpreter. It
imports nothing heavy, hands the server its stdin, stdout and stderr, passes on the signals it gets to the child, and
exits as the child did. The child's environment is this process's, without FORK_SERVER_SOCKET."""

import io
import json
import os
import signal
import socket
import sys

SOCKET = "FORK_SERVER_SOCKET"

env = dict(os.environ)
server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
server.connect(env.pop(SOCKET))
# What python set up at this start that a fork would not: unbuffered output (-u), SIGINT (ignored where it started so).
request = {
    "argv": sys.argv[1:], "env": env, "cwd": os.getcwd(), "unbuffered": isinstance(sys.stdout.buffer, io.FileIO),
    "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
}  # fmt: skip
socket.send_fds(server, [json.dumps(request).encode()], [0, 1, 2])
started = json.loads(server.recv(1 << 16))
if "refused" in started:
    sys.exit(f"fork_client: {started['refused']}")
child = started["pid"]


def pass_on(number: int, _frame: object) -> None:
    try:
        os.kill(child, number)
    except ProcessLookupError:  # it has just ended
        pass


for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, pass_on)
ended = server.recv(1 << 16)  # retried after each signal (PEP 475)
returncode = json.loads(ended)["returncode"] if ended else 1
if returncode < 0:  # killed by a signal: so is this process
    signal.signal(-returncode, signal.SIG_DFL)
    os.kill(os.getpid(), -returncode)
sys.exit(returncode)
