"""error-on-graph-break: ``torch._dynamo.error_on_graph_break(...)`` acts in the thread that sets it.

Whether Dynamo raises on a graph break instead of splitting the graph is one module global,
``torch._dynamo.utils._error_on_graph_break``, set through ``_set_error_on_graph_break`` by the
``torch._dynamo.error_on_graph_break()`` context and by every call of a function compiled with
``torch.compile(..., error_on_graph_break=...)``, and read when any thread starts tracing a frame. So while one
thread is inside ``error_on_graph_break(True)``, another thread's compile of a function with a graph break raises
``Unsupported`` instead of splitting it (the self-test below), and the reverse: one thread's
``error_on_graph_break(False)`` silently lets through the graph breaks of a thread inside
``error_on_graph_break(True)`` (both reproduced on torch 2.13). A global from 2.9 (which added the setting) to 2.15.

The global moves to a ``threading.local`` (``utils._error_on_graph_break_tls``) with :class:`ThreadLocalGlobals`:
its two accessors are the only code that reads or writes it. A thread starts with torch's default (False).
Not covered: Dynamo tracing on a thread other than the one that set the value (compiled autograd on autograd's
device thread) reads that thread's own value.
"""

from __future__ import annotations

import threading

from .._fix import Scenario, releases
from .._patch import moved_globals_fix
from .._selftest import Result, fresh

MODULE = "torch._dynamo.utils"


def error_on_graph_break_elsewhere(timeout: float = 60.0) -> Result | None:
    """While thread A is inside ``torch._dynamo.error_on_graph_break(True)``, the main thread compiles a function
    with a graph break: it must split the graph and run. Then A compiles one inside its context: that must raise.
    None where torch has no ``torch._dynamo.error_on_graph_break``."""
    import torch

    error_on_graph_break = getattr(torch._dynamo, "error_on_graph_break", None)
    if error_on_graph_break is None:
        return None

    def with_graph_break(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    def compile_and_run() -> str:
        try:
            result = torch.compile(fresh(with_graph_break), backend="eager")(torch.ones(2))
        except Exception as exc:
            return f"raised {type(exc).__name__}: {str(exc).splitlines()[0]}"
        return "ran" if result.tolist() == [4.0, 4.0] else f"returned {result.tolist()}"

    inside, release, in_a = threading.Event(), threading.Event(), []

    def strict_thread() -> None:
        with error_on_graph_break(True):
            inside.set()
            release.wait(timeout)
            in_a.append(compile_and_run())

    thread = threading.Thread(target=strict_thread, name="torchfix-selftest")
    thread.start()
    inside.wait(timeout)
    try:
        mine = compile_and_run()
    finally:
        release.set()
        thread.join(timeout)
    theirs = (in_a or ["no answer"])[0]
    detail = f"the main thread's compile {mine}; the compile in error_on_graph_break(True) {theirs}"
    return Result(
        "error on graph break (error_on_graph_break(True) in one thread, a graph break compiled in another)",
        mine != "ran" or not theirs.startswith("raised Unsupported"),
        detail,
    )


FIX = moved_globals_fix(
    "error-on-graph-break",
    "while one thread is inside torch._dynamo.error_on_graph_break(True), other threads' graph breaks raise "
    "Unsupported (and one thread's error_on_graph_break(False) lets another's through)",
    "2.9",
    MODULE,
    "_error_on_graph_break_tls",
    {"_error_on_graph_break": "error_on_graph_break"},
    order=65,
    trigger=MODULE,
    scenarios=(
        Scenario(
            error_on_graph_break_elsewhere,
            releases("2.9"),
            needs="torch._dynamo.error_on_graph_break",
            shows="the main thread's compile raised Unsupported",
        ),
    ),
)
