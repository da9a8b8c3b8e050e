"""Live reproductions of the thread hazards, used by ``python -m torchfix`` and by the test suite.

Each scenario forces the bad interleaving with events (one thread holds a trace open while another
thread acts), so it shows the hazard every time on a torch that has it, and never on one that does not.
Each returns a :class:`Result`: ``hazard`` says whether the hazard showed, ``detail`` what was seen.
Run them in a process you can throw away: on an unpatched torch, H2 leaves the process broken.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

NESTED_TRACE_ERROR = "Detected that you are using FX to symbolically trace a dynamo-optimized function"


@dataclass(frozen=True)
class Result:
    scenario: str
    hazard: bool
    detail: str


def _add_one(x):
    return x + 1


def _compiled_add_one() -> Callable:
    import torch

    compiled = torch.compile(_add_one, backend="eager")
    compiled(torch.ones(2))  # compiled before any trace starts (Dynamo captures its predicate here)
    return compiled


def _call(compiled: Callable) -> str | None:
    """Call a compiled function; the nested-trace error's message if it raised it."""
    import torch

    try:
        compiled(torch.ones(2))
    except RuntimeError as exc:
        if NESTED_TRACE_ERROR in str(exc):
            return str(exc)
        raise
    return None


class _HeldTrace:
    """A thread inside ``Tracer.trace`` (via ``symbolic_trace`` or ``make_fx``) until released.

    ``with _HeldTrace(...):`` returns once the thread is inside the traced function, and lets the
    trace finish on exit.
    """

    def __init__(self, tracer: str, timeout: float) -> None:
        self.tracer, self.timeout = tracer, timeout
        self.inside, self.release = threading.Event(), threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name=f"held-{tracer}", daemon=True)

    def _run(self) -> None:
        import torch
        from torch.fx.experimental.proxy_tensor import make_fx

        def held_open(x):  # a plain function: symbolic_trace reads its __globals__
            self.inside.set()
            self.release.wait(self.timeout)
            return x + 1

        try:
            if self.tracer == "symbolic_trace":
                torch.fx.symbolic_trace(held_open)
            else:
                make_fx(held_open)(torch.ones(2))
        except BaseException as exc:  # reported by __exit__
            self.errors.append(exc)

    def __enter__(self) -> _HeldTrace:
        self.thread.start()
        if not self.inside.wait(self.timeout):
            self.thread.join(self.timeout)
            if self.errors:
                raise self.errors[0]
            raise TimeoutError(f"the {self.tracer} thread never entered its trace")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release.set()
        self.thread.join(self.timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"the {self.tracer} thread did not finish its trace")
        if self.errors and exc_info[0] is None:
            raise self.errors[0]


def h1_nested_trace_error(
    tracer: str = "symbolic_trace", timeout: float = 60.0, compiled: Callable | None = None
) -> Result:
    """H1: while thread A traces, a compiled call in thread B raises (or runs eagerly).

    ``compiled`` may be a function the caller compiled earlier (before ``import torchfix``, say).
    """
    compiled = compiled or _compiled_add_one()
    with _HeldTrace(tracer, timeout):
        error = _call(compiled)
    return Result(f"H1 ({tracer} in one thread, compiled call in another)", error is not None, error or "ok")


def _set_compilation_env() -> Callable | None:
    import importlib

    for module in ("torch._higher_order_ops.utils", "torch._higher_order_ops.cond"):  # 2.3+, 2.2
        try:
            found = getattr(importlib.import_module(module), "_set_compilation_env", None)
        except ImportError:
            continue
        if found is not None:
            return found
    return None


def _fx_flag() -> bool:
    import torch.fx._symbolic_trace as st

    # torch 2.14+ (and torchfix) have the accessor; before, the plain global.
    getter = getattr(st, "_get_is_fx_tracing", None)
    return bool(getter() if getter else st._is_fx_tracing_flag)


def _flag_in_new_thread() -> bool:
    seen: list[bool] = []
    thread = threading.Thread(target=lambda: seen.append(_fx_flag()))
    thread.start()
    thread.join()
    return seen[0]


def h2_stuck_flag(timeout: float = 60.0) -> Result | None:
    """H2: ``_set_compilation_env`` interleaved with a trace leaves the flag stuck True for everyone.

    None where torch has no ``_set_compilation_env`` (before 2.2).
    """
    set_compilation_env = _set_compilation_env()
    if set_compilation_env is None:
        return None
    compiled = _compiled_add_one()
    held = _HeldTrace("symbolic_trace", timeout).__enter__()  # A: flag True
    with set_compilation_env():  # B: saves True, sets False
        held.__exit__(None, None, None)  # A: restores False
    # B restored what it saved: the flag of a trace that has ended.
    stuck = _fx_flag() or _flag_in_new_thread()
    error = _call(compiled)
    detail = f"flag stuck True after both finished; next compiled call: {error}" if stuck else "ok"
    return Result("H2 (_set_compilation_env interleaved with a trace)", stuck or error is not None, detail)


def many_threads(rounds: int = 20, callers: int = 4, timeout: float = 60.0) -> Result:
    """H1 under load: in each round one thread traces (symbolic_trace and make_fx in turn) while
    ``callers`` threads each make a compiled call; a barrier makes every call land inside the trace.
    """
    compiled = _compiled_add_one()
    errors: list[str] = []
    failures: list[BaseException] = []
    inside = threading.Barrier(callers + 1, timeout=timeout)
    done = threading.Barrier(callers + 1, timeout=timeout)

    def caller() -> None:
        try:
            for _ in range(rounds):
                inside.wait()
                error = _call(compiled)
                if error:
                    errors.append(error)
                done.wait()
        except BaseException as exc:
            failures.append(exc)
            inside.abort()
            done.abort()

    threads = [threading.Thread(target=caller, name=f"caller-{i}", daemon=True) for i in range(callers)]
    for thread in threads:
        thread.start()
    try:
        for round_no in range(rounds):
            held = _HeldTrace("symbolic_trace" if round_no % 2 == 0 else "make_fx", timeout)
            with held:
                inside.wait()
                done.wait()
    finally:
        for thread in threads:
            thread.join(timeout)
    if failures:
        raise failures[0]
    calls = rounds * callers
    return Result(
        f"H1 x{calls} ({callers} threads calling while another traces, {rounds} rounds)",
        bool(errors),
        f"{len(errors)} of {calls} compiled calls failed" if errors else f"all {calls} compiled calls ran",
    )


def run_all(timeout: float = 60.0) -> list[Result]:
    results = [h1_nested_trace_error("symbolic_trace", timeout), h1_nested_trace_error("make_fx", timeout)]
    h2 = h2_stuck_flag(timeout)  # last: without the fix it breaks the process for good
    return results + ([h2] if h2 else [])
