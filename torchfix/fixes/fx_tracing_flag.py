"""fx-tracing-flag: ``torch.fx._symbolic_trace._is_fx_tracing_flag`` becomes per-thread (hazards H1, H2).

torch 2.0 - 2.13 keep the flag in a module global. ``Tracer.trace`` (symbolic_trace, make_fx and so
every AOTAutograd compile) sets it for the whole trace, and the wrapper of every ``torch.compile``d
function checks it on each call, so one thread's trace makes other threads' compiled calls raise
"Detected that you are using FX to symbolically trace a dynamo-optimized function" (or run eagerly).
``_set_compilation_env`` saves/sets/restores it by module attribute, and interleaved with a trace in
another thread that leaves it stuck True for the life of the process.

This backports torch 2.14's own fix (pytorch/pytorch#168999): the flag lives in a ``threading.local``
named ``_is_fx_tracing_tls`` with the accessors ``_get_is_fx_tracing`` / ``_set_is_fx_tracing`` /
``_is_fx_tracing_context``, and non-reentrant checkpoint recompute, which can run on autograd's device
thread, re-applies the value the flag had when the forward ran.
"""

from __future__ import annotations

import ast
import contextlib
import sys
import threading
import types
from collections.abc import Callable, Iterator

from .._fix import Fix, Scenario, SoakCheck, releases
from ..doctor.scenarios import NESTED_TRACE_ERROR, HeldTrace, Result, call_compiled, compiled_add_one
from ..patching.patches import AttributeUses, SourcePatch, ThreadLocalGlobals
from ..patching.source import Edit, ShapeError, definitions, find_replaced, insert_at, nested_function, parse

MODULE = "torch.fx._symbolic_trace"
FLAG = "_is_fx_tracing_flag"
HOLDER = "_is_fx_tracing_tls"
CAPTURED = "_torchfix_is_fx_tracing"  # parameter default of the recompute closure: evaluated at forward time


def _accessors(module: types.ModuleType) -> dict[str, object]:
    """torch 2.14's accessor functions, bound to ``module``'s holder."""
    holder = vars(module)[HOLDER]

    def _set_is_fx_tracing(value: bool) -> None:
        holder.flag = value

    def _get_is_fx_tracing() -> bool:
        return holder.flag

    @contextlib.contextmanager
    def _is_fx_tracing_context(value: bool) -> Iterator[None]:
        previous = holder.flag
        holder.flag = value
        try:
            yield
        finally:
            holder.flag = previous

    return {f.__name__: f for f in (_set_is_fx_tracing, _get_is_fx_tracing, _is_fx_tracing_context)}


# Modules that write the flag as a module attribute: 2.3+, and 2.2.
_WRITERS = (
    ("torch._higher_order_ops.utils", "torch/_higher_order_ops/utils.py"),
    ("torch._higher_order_ops.cond", "torch/_higher_order_ops/cond.py"),
)
_ACCESSORS = ("_get_is_fx_tracing", "_set_is_fx_tracing", "_is_fx_tracing_context")


class _FlagPatch(ThreadLocalGlobals):
    def __init__(self) -> None:
        super().__init__(MODULE, "torch/fx/_symbolic_trace.py", HOLDER, {FLAG: "flag"}, seen_in_backward=True)
        self._added: list[str] = []

    def describe(self) -> str:
        return super().describe() + f"; adds torch 2.14's accessors {', '.join(_ACCESSORS)} where missing"

    def _install_state(self, module: types.ModuleType, source: str) -> None:
        super()._install_state(module, source)
        namespace = vars(module)
        self._added = [name for name in _accessors(module) if name not in namespace]
        namespace.update({name: f for name, f in _accessors(module).items() if name in self._added})

    def _remove_state(self, module: types.ModuleType) -> None:
        for name in self._added:
            vars(module).pop(name, None)
        super()._remove_state(module)


class _CheckpointRecompute(SourcePatch):
    """Non-reentrant checkpoint recompute runs with the FX flag of its forward.

    The recompute closure is defined while the forward runs, so a parameter default evaluated at
    ``def`` time captures the forward thread's flag; the recomputing call is wrapped in
    ``_is_fx_tracing_context(captured)``. Both edits stay on their lines, so line numbers do not move.
    """

    # (outer function, recompute closure inside it, name of the user function it calls): torch 2.1+,
    # then torch 2.0, where recompute happens in the saved-tensor `unpack` hook.
    SHAPES = (
        ("_checkpoint_without_reentrant_generator", "recompute_fn", "fn"),
        ("_checkpoint_without_reentrant", "unpack", "function"),
    )

    def __init__(self) -> None:
        super().__init__("torch.utils.checkpoint", "torch/utils/checkpoint.py")

    def edits(self, source: str) -> list[Edit]:
        tree = parse(source)
        for outer, closure_name, user_fn in self.SHAPES:
            if outer in definitions(source):
                closure = nested_function(self.relpath, tree, [outer, closure_name])
                return [self._capture(closure), self._reapply(closure, user_fn)]
        raise ShapeError(f"{self.relpath}: no non-reentrant checkpoint recompute function found")

    @staticmethod
    def _capture(closure: ast.FunctionDef) -> Edit:
        args = closure.args
        last = args.vararg or (args.args or args.posonlyargs or [None])[-1]
        if last is None or last.lineno != closure.lineno:
            raise ShapeError(f"line {closure.lineno}: unexpected signature of {closure.name}")
        return insert_at(last.end_lineno, last.end_col_offset, f", {CAPTURED}={MODULE}.{HOLDER}.flag")

    def _reapply(self, closure: ast.FunctionDef, user_fn: str) -> Edit:
        (call,) = find_replaced(
            self.relpath,
            closure,
            f"call of {user_fn}(...) in {closure.name}",
            lambda stmt: (
                isinstance(stmt, (ast.Expr, ast.Assign))
                and isinstance(stmt.value, ast.Call)
                and isinstance(stmt.value.func, ast.Name)
                and stmt.value.func.id == user_fn
            ),
        )
        if call.lineno != call.end_lineno:
            raise ShapeError(f"{self.relpath} line {call.lineno}: expected a one-line call of {user_fn}(...)")
        return insert_at(call.lineno, call.col_offset, f"with {MODULE}._is_fx_tracing_context({CAPTURED}): ")


def _probe() -> str | None:
    module = sys.modules.get(MODULE) or __import__(MODULE, fromlist=["_"])
    if isinstance(vars(module).get(FLAG), bool):
        return None
    if HOLDER in vars(module):
        return "torch keeps the FX tracing flag per thread already (upstream fix, torch 2.14+)"
    return f"{MODULE} has no global {FLAG}"


def h1_nested_trace_error(
    tracer: str = "symbolic_trace", timeout: float = 60.0, compiled: Callable | None = None
) -> Result:
    """H1: while thread A traces, a compiled call in thread B raises (or runs eagerly).

    ``compiled`` may be a function the caller compiled earlier (before ``import torchfix``, say).
    """
    compiled = compiled or compiled_add_one()
    with HeldTrace(tracer, timeout):
        error = call_compiled(compiled)
    return Result(f"H1 ({tracer} in one thread, compiled call in another)", error is not None, error or "ok")


def _find_set_compilation_env() -> Callable | None:
    """torch's ``_set_compilation_env`` (2.2+), None where there is none."""
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
    set_compilation_env = _find_set_compilation_env()
    if set_compilation_env is None:
        return None
    compiled = compiled_add_one()
    held = HeldTrace("symbolic_trace", timeout).__enter__()  # A: flag True
    with set_compilation_env():  # B: saves True, sets False
        held.__exit__(None, None, None)  # A: restores False
    # B restored what it saved: the flag of a trace that has ended.
    stuck = _fx_flag() or _flag_in_new_thread()
    error = call_compiled(compiled)
    detail = f"flag stuck True after both finished; next compiled call: {error}" if stuck else "ok"
    return Result("H2 (_set_compilation_env interleaved with a trace)", stuck or error is not None, detail)


def many_threads(rounds: int = 20, callers: int = 4, timeout: float = 60.0) -> Result:
    """H1 under load: in each round one thread traces (symbolic_trace and make_fx in turn) while
    ``callers`` threads each make a compiled call; a barrier makes every call land inside the trace.
    """
    compiled = compiled_add_one()
    errors: list[str] = []
    failures: list[BaseException] = []
    inside = threading.Barrier(callers + 1, timeout=timeout)
    done = threading.Barrier(callers + 1, timeout=timeout)

    def caller() -> None:
        try:
            for _ in range(rounds):
                inside.wait()
                error = call_compiled(compiled)
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
            held = HeldTrace("symbolic_trace" if round_no % 2 == 0 else "make_fx", timeout)
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


def soak_leak_probe() -> Callable[[bool], bool]:
    """Whether the calling thread is inside an FX trace."""
    import torch.fx

    return lambda at_end: torch.fx._symbolic_trace.is_fx_tracing()


FIX = Fix(
    name="fx-tracing-flag",
    order=10,
    hazard="one thread's FX trace (symbolic_trace, make_fx, AOTAutograd) breaks compiled calls in other threads",
    versions=releases("2.0", "2.13"),
    probe=_probe,
    patches=lambda _torch_version: [
        _FlagPatch(),
        # _set_compilation_env (eager flex_attention, cond, while_loop, ...) saves, clears and restores it.
        *(AttributeUses(module, relpath, MODULE, HOLDER, {FLAG: "flag"}) for module, relpath in _WRITERS),
        _CheckpointRecompute(),
    ],
    scenarios=(
        Scenario(h1_nested_trace_error, releases("2.0", "2.13"), args=("symbolic_trace",)),
        Scenario(h1_nested_trace_error, releases("2.0", "2.13"), args=("make_fx",)),
        Scenario(h2_stuck_flag, releases("2.2", "2.13"), needs="torch._dynamo's _set_compilation_env (2.2+)", stage=1),
    ),
    shared_state=(
        "H1, H2: `torch.fx._symbolic_trace._is_fx_tracing_flag` is a process global, set by every FX trace "
        "(symbolic_trace, make_fx, AOTAutograd) and checked by every compiled call"
    ),
    symptom=(
        "other threads' compiled calls raise the nested-trace `RuntimeError` (or, with "
        "`error_on_nested_fx_trace=False`, run uncompiled); `_set_compilation_env` (eager `flex_attention`, "
        "`cond`, `while_loop`, …) interleaved with a trace leaves the flag stuck `True` for good"
    ),
    releases_note='2.14 made it per-thread upstream: "not needed"',
    caveats=(
        "It also backports what torch 2.14 does beyond the flag: non-reentrant checkpoint recompute (which can "
        "run on autograd's device thread) re-applies the flag's value from the forward."
    ),
    soak=SoakCheck(errors=(NESTED_TRACE_ERROR,), leak_probe=soak_leak_probe),
)
