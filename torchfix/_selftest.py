"""Live reproductions of the thread hazards, used by ``python -m torchfix`` and by the test suite.

Each scenario forces the bad interleaving with events (one thread holds a trace open while another
thread acts), so it shows the hazard every time on a torch that has it, and never on one that does not.
Each returns a :class:`Result`: ``hazard`` says whether the hazard showed, ``detail`` what was seen.
Run them in a process you can throw away: on an unpatched torch, H2 leaves the process broken.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

NESTED_TRACE_ERROR = "Detected that you are using FX to symbolically trace a dynamo-optimized function"


@dataclass(frozen=True)
class Result:
    scenario: str
    hazard: bool
    detail: str


def _add_one(x):
    return x + 1


def _fresh_add_one() -> Callable:
    """``_add_one`` with a code object of its own: Dynamo keeps compiled code on the code object, so a scenario
    compiling this meets nothing an earlier scenario (or an earlier run of itself) compiled."""
    return types.FunctionType(_add_one.__code__.replace(), globals(), "_add_one")


def _compiled_add_one() -> Callable:
    import torch

    compiled = torch.compile(_fresh_add_one(), backend="eager")
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


# The graph symbolic_trace must make of _module_around: x + 1, then the Linear as a leaf module.
MODULE_GRAPH = ["placeholder", "call_function", "call_module", "output"]


def _module_around(inner: Callable):
    """A module whose forward runs ``inner`` (traced through) and then a submodule (a leaf)."""
    import torch

    class Around(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.linear(inner(x))

    return Around()


def _graph_ops(module) -> list[str]:
    import torch

    return [node.op for node in torch.fx.symbolic_trace(module).graph.nodes]


class _HeldTrace:
    """A thread inside ``Tracer.trace`` (``symbolic_trace`` of a function, ``symbolic_trace_module``
    of a module with a submodule, ``make_fx``), or inside a ``torch.compile`` (``"compile"``: its backend
    holds the compile open), until released.

    ``with _HeldTrace(...):`` returns once the thread is inside the traced function (or the backend),
    and lets the trace finish on exit. ``seen_inside`` holds what ``probe`` returned in there;
    ``graph_ops`` the node kinds of a ``symbolic_trace_module`` graph.
    """

    def __init__(self, tracer: str, timeout: float, probe: Callable[[], object] | None = None) -> None:
        self.tracer, self.timeout, self.probe = tracer, timeout, probe
        self.inside, self.release = threading.Event(), threading.Event()
        self.errors: list[BaseException] = []
        self.seen_inside: list[object] = []
        self.graph_ops: list[str] = []
        self.thread = threading.Thread(target=self._run, name=f"held-{tracer}", daemon=True)

    def _hold(self) -> None:
        if self.probe is not None:
            self.seen_inside.append(self.probe())
        self.inside.set()
        self.release.wait(self.timeout)

    def _run(self) -> None:
        import torch
        from torch.fx.experimental.proxy_tensor import make_fx

        def held_open(x):  # a plain function: symbolic_trace reads its __globals__
            self._hold()
            return x + 1

        def held_backend(gm, example_inputs):
            self._hold()
            return gm.forward

        try:
            if self.tracer == "symbolic_trace":
                torch.fx.symbolic_trace(held_open)
            elif self.tracer == "symbolic_trace_module":
                self.graph_ops = _graph_ops(_module_around(held_open))
            elif self.tracer == "make_fx":
                make_fx(held_open)(torch.ones(2))
            else:
                torch.compile(_add_one, backend=held_backend)(torch.ones(2))
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


def h3_is_compiling_elsewhere(timeout: float = 60.0) -> Result | None:
    """H3: while thread A compiles (its backend held open), ``torch.compiler.is_compiling()`` in thread B.

    From torch 2.13 every Dynamo compile sets the flag (before, only export paths do). None where torch
    has no ``torch.compiler.is_compiling`` (before 2.3).
    """
    import torch

    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if is_compiling is None:
        return None
    with _HeldTrace("compile", timeout, probe=is_compiling) as held:
        elsewhere = is_compiling()
    detail = (
        f"is_compiling() during another thread's compile: {elsewhere} (in the compiling thread: {held.seen_inside[0]})"
    )
    return Result("H3 (torch.compile in one thread, is_compiling() in another)", elsewhere, detail)


def stance_elsewhere(timeout: float = 60.0) -> Result | None:
    """While thread A is inside ``with torch.compiler.set_stance("force_eager")``, the main thread calls a
    function compiled with a backend that counts its compiles: it must compile. None before torch 2.6."""
    import torch

    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:
        return None
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(len(example_inputs))
        return gm.forward

    def triple(x):
        return x * 3

    inside, release = threading.Event(), threading.Event()

    def evaluate() -> None:
        with set_stance("force_eager"):
            inside.set()
            release.wait(timeout)

    thread = threading.Thread(target=evaluate, name="torchfix-selftest")
    thread.start()
    inside.wait(timeout)
    try:
        torch.compile(triple, backend=counting)(torch.ones(2))
    finally:
        release.set()
        thread.join(timeout)
    detail = f"the backend compiled {len(compiles)} graph(s) for the call"
    return Result("stance (set_stance('force_eager') in one thread, a compiled call in another)", not compiles, detail)


def guarded_backends_elsewhere(timeout: float = 60.0) -> Result:
    """The main thread compiles a function; a new thread compiles and calls it with another
    ``torch.compile`` (another backend object): the call must run, not fail the first compile's guard with
    ``KeyError`` (torch 2.2 keeps the backends guards look up per thread)."""
    import torch

    def triple(x):
        return x * 3

    def backend() -> Callable:
        return lambda gm, example_inputs: gm.forward  # a new object each time: guards tell them apart

    torch.compile(triple, backend=backend())(torch.ones(2))
    outcome = _in_thread(lambda: torch.compile(triple, backend=backend())(torch.ones(2)), timeout)
    failed = isinstance(outcome, BaseException)
    detail = f"raised {type(outcome).__name__}: {outcome}" if failed else "ran"
    return Result("guarded backends (compiled in one thread, compiled again and called in another)", failed, detail)


def cached_ops_elsewhere(timeout: float = 60.0) -> Result | None:
    """The main thread iterates ``torch._ops.get_cached_ops()``, as entering a pre-dispatch mode (an export)
    does; halfway, another thread caches an operator overload's dispatch for the first time
    (``add_cached_op``). The iteration must finish. None before torch 2.1."""
    import torch
    from torch import _ops

    if not hasattr(_ops, "get_cached_ops"):
        return None
    aten = torch.ops.aten
    for op in (aten.sin.default, aten.cos.default):  # at least two, so that the iteration has a halfway
        _ops.add_cached_op(op)
    candidates = (aten.tan.default, aten.atan.default, aten.sinh.default, aten.cosh.default, aten.tanh.default)
    fresh = next((op for op in candidates if op not in _ops.cached_ops), None)
    if fresh is None:
        return Result("cached ops", False, "every candidate operator is cached already: nothing to add")
    ops = iter(_ops.get_cached_ops())
    next(ops)
    _in_thread(lambda: _ops.add_cached_op(fresh), timeout)
    try:
        rest = sum(1 for _ in ops)
    except RuntimeError as exc:
        return Result("cached ops (iterated in one thread, added to in another)", True, f"raised {exc}")
    return Result("cached ops (iterated in one thread, added to in another)", False, f"iterated {rest + 1} ops")


def node_meta_elsewhere(timeout: float = 60.0) -> Result:
    """While thread A records node metadata (``preserve_node_meta()`` and a stack trace, as Dynamo and
    AOTAutograd do for every graph they build), what the main thread's FX graphs would record: nothing."""
    from torch.fx import traceback as fx_traceback

    marker = "torchfix-selftest stack\n"
    inside, release = threading.Event(), threading.Event()

    def record() -> None:
        with fx_traceback.preserve_node_meta():
            fx_traceback.set_stack_trace([marker])
            inside.set()
            release.wait(timeout)

    thread = threading.Thread(target=record, name="torchfix-selftest")
    thread.start()
    inside.wait(timeout)
    preserved, meta = fx_traceback.has_preserved_node_meta(), fx_traceback.get_current_meta()
    release.set()
    thread.join(timeout)
    leaked = preserved or marker in str(meta.get("stack_trace"))
    detail = f"has_preserved_node_meta() {preserved}; stack_trace {meta.get('stack_trace')!r}"
    return Result("node meta (recorded in one thread, read by another thread's graphs)", leaked, detail)


def export_load_elsewhere(timeout: float = 60.0) -> Result | None:
    """While thread A is inside ``torch.export.load`` (held at its first torch function once torch's
    deserializer is at work, by a ``TorchFunctionMode`` of that thread), the main thread loads the same
    program: both must load. None where torch has no deserializer global to hold a load at (before 2.3)."""
    import io

    import torch
    from torch.overrides import TorchFunctionMode

    export = getattr(torch, "export", None)
    if export is None or not hasattr(export, "load"):
        return None
    from torch._export.serde import serialize

    if not {"_CURRENT_DESERIALIZER", "_deserializer_tls"} & vars(serialize).keys():
        return None  # before 2.3: no deserializer global, and no point to hold a load at
    saved = io.BytesIO()
    export.save(export.export(torch.nn.Linear(2, 2), (torch.ones(1, 2),)), saved)

    inside, release = threading.Event(), threading.Event()

    class HoldInsideLoad(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            # The deserializer torch has at work, as the calling thread sees it (None before 2.3).
            if not inside.is_set() and getattr(serialize, "_CURRENT_DESERIALIZER", None) is not None:
                inside.set()
                release.wait(timeout)
            return func(*args, **(kwargs or {}))

    def load() -> str:
        try:
            export.load(io.BytesIO(saved.getvalue()))
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "loaded"

    def held_load() -> str:
        with HoldInsideLoad():
            return load()

    held: list[str] = []
    thread = threading.Thread(target=lambda: held.append(held_load()), name="torchfix-selftest")
    thread.start()
    inside.wait(timeout)
    mine = load()
    release.set()
    thread.join(timeout)
    detail = f"the main thread's load: {mine}; the held thread's: {(held or ['no answer'])[0]}"
    return Result(
        "export (torch.export.load in two threads at once)", (held or [""])[0] != "loaded" or mine != "loaded", detail
    )


_HELD_FAKE_OP: list[object] = []  # the scenario's custom operator: registered once per process


def fake_impl_ctx_elsewhere(timeout: float = 60.0) -> Result | None:
    """While thread A runs a custom operator's fake implementation (under a FakeTensorMode; it waits there),
    the main thread, which runs none, calls ``torch.library.get_ctx()``: it must get no context (None), not
    A's. None where torch has no ``torch.library.custom_op`` (before 2.4)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not hasattr(torch.library, "custom_op") or not hasattr(torch.library, "get_ctx"):
        return None
    inside, release = threading.Event(), threading.Event()
    if not _HELD_FAKE_OP:
        # The schema is given: this file's annotations are strings (from __future__), which custom_op cannot read.
        @torch.library.custom_op("torchfix_selftest::held_fake", mutates_args=(), schema="(Tensor x) -> Tensor")
        def held_fake(x):
            return x.clone()

        _HELD_FAKE_OP.append(held_fake)
    op = _HELD_FAKE_OP[0]

    def fake(x):
        inside.set()
        release.wait(timeout)
        return torch.empty_like(x)

    op.register_fake(fake)  # replaces the previous run's (its events are spent)
    errors: list[str] = []

    def run_fake() -> None:
        try:
            with FakeTensorMode() as mode:
                op(mode.from_tensor(torch.ones(2)))
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=run_fake, name="torchfix-selftest", daemon=True)
    thread.start()
    if not inside.wait(timeout):
        thread.join(timeout)
        return Result("fake impl ctx", True, f"the fake implementation never ran: {errors}")
    seen = torch.library.get_ctx()
    release.set()
    thread.join(timeout)
    detail = f"the main thread's get_ctx(): {type(seen).__name__}" + (f"; A raised {errors[0]}" if errors else "")
    return Result(
        "fake impl ctx (get_ctx() while another thread runs a fake implementation)",
        seen is not None or bool(errors),
        detail,
    )


def make_fx_tracer_elsewhere(timeout: float = 60.0) -> Result | None:
    """Thread A holds a ``make_fx`` trace open; thread B starts one of a function with ``torch.cond`` and
    waits inside it; A finishes; then B's ``torch.cond`` traces. B must trace the cond with its own tracer,
    and no tracer may be left behind once both are done. None where torch has no make_fx tracer global
    (before 2.4)."""
    import torch
    from torch.fx.experimental import proxy_tensor

    if not hasattr(proxy_tensor, "_set_make_fx_tracer") or not hasattr(torch, "cond"):
        return None
    inside, go_on = threading.Event(), threading.Event()
    problems: list[str] = []

    def with_cond(x):
        inside.set()
        go_on.wait(timeout)
        return torch.cond(x.sum() > 0, lambda y: y.sin(), lambda y: y.cos(), (x,))

    def trace() -> None:
        try:
            ops = [node.target for node in proxy_tensor.make_fx(with_cond)(torch.ones(2)).graph.nodes]
            if torch.ops.higher_order.cond not in ops:
                problems.append(f"B's graph has no cond: {ops}")
        except Exception as exc:
            problems.append(f"B raised {type(exc).__name__}: {str(exc)[:200]}")

    held = _HeldTrace("make_fx", timeout).__enter__()
    b = threading.Thread(target=trace, name="torchfix-selftest", daemon=True)
    b.start()
    inside.wait(timeout)
    held.__exit__(RuntimeError, None, None)  # A finishes while B traces; its errors are collected here
    problems += [f"A raised {exc!r}" for exc in held.errors]
    go_on.set()
    b.join(timeout)
    if getattr(proxy_tensor, "_CURRENT_MAKE_FX_TRACER", None) is not None:
        problems.append("a finished tracer was left behind")
    detail = "; ".join(problems) or "both traced"
    return Result("make_fx tracer (two threads tracing with make_fx at once)", bool(problems), detail)


def export_save_elsewhere(timeout: float = 60.0) -> Result | None:
    """While thread A is inside ``torch.export.save`` (pickling its example inputs, one of which waits
    there), thread B saves another program. B must save (with the fix it waits for A's part to be pickled),
    not raise "Refusing to stomp on existing FakeTensor reducer". None where this torch does not pickle an
    exported program's example inputs (before 2.4) or cannot export."""
    import copy
    import io

    import torch

    if not hasattr(getattr(torch, "export", None), "save"):
        return None
    inside, progress, release = threading.Event(), threading.Event(), threading.Event()

    class Held:
        def __reduce__(self):
            inside.set()
            progress.set()
            release.wait(timeout)
            return (int, (0,))  # pickled as a plain 0

    program = torch.export.export(torch.nn.Linear(2, 2), (torch.ones(1, 2),))
    held = copy.copy(program)
    held._example_inputs = ((Held(),), {})
    errors: dict[str, str] = {}

    def save(name: str, exported: object) -> None:
        try:
            torch.export.save(exported, io.BytesIO())
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
        finally:
            progress.set()

    a = threading.Thread(target=save, args=("A", held), name="torchfix-selftest-a", daemon=True)
    a.start()
    progress.wait(timeout)
    if not inside.is_set():  # A saved without pickling its example inputs
        a.join(timeout)
        return None if "A" not in errors else Result("export save", True, f"the held save raised {errors['A']}")
    b = threading.Thread(target=save, args=("B", program), name="torchfix-selftest-b", daemon=True)
    b.start()
    # Without the fix B fails at once; with it, B waits for A's lock until A is released.
    b.join(2.0)
    release.set()
    a.join(timeout)
    b.join(timeout)
    detail = "; ".join(f"{name} raised {error[:200]}" for name, error in sorted(errors.items())) or "both saved"
    return Result("export save (torch.export.save in two threads at once)", bool(errors), detail)


def _export_call_graph(module: object) -> str:
    """A non-strict export of ``module``: the fully qualified names of the program's module call graph (torch
    2.2 records only ""), what the export raised, or "no non-strict export" where this torch has none."""
    import torch

    try:
        program = torch.export.export(module, (torch.ones(1, 2),), strict=False)
    except TypeError as exc:
        if "strict" in str(exc):
            return "no non-strict export"
        raise
    except Exception as exc:
        return f"raised {type(exc).__name__}: {exc}"
    return ",".join(entry.fqn for entry in program.module_call_graph)


class _HeldExport:
    """A thread inside a non-strict ``torch.export.export`` of a module (its submodule named ``held``) whose
    forward waits there, until released. ``with _HeldExport(timeout) as held:`` returns once the thread is
    inside the forward, or gave up (``held.inside`` False); on exit the export goes on, and ``held.outcome``
    is what :func:`_export_call_graph` made of it."""

    def __init__(self, timeout: float) -> None:
        import torch

        self.timeout = timeout
        self.entered, self.release = threading.Event(), threading.Event()
        self.answers: list[str] = []
        entered, release = self.entered, self.release

        class Held(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.held = torch.nn.Linear(2, 2)

            def forward(self, x):
                if not entered.is_set():
                    entered.set()
                    release.wait(timeout)
                return self.held(x)

        module = Held()
        self.thread = threading.Thread(
            target=lambda: self.answers.append(_export_call_graph(module)), name="torchfix-selftest", daemon=True
        )

    @property
    def inside(self) -> bool:
        return self.entered.is_set()

    @property
    def outcome(self) -> str:
        return self.answers[0] if self.answers else "no answer"

    def __enter__(self) -> _HeldExport:
        self.thread.start()
        if not self.entered.wait(self.timeout):
            self.thread.join(self.timeout)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release.set()
        self.thread.join(self.timeout)


def _export_never_held(held: _HeldExport, scenario: str) -> Result | None:
    """The result of a scenario whose export never reached its forward: None where torch has no non-strict
    export, a failure otherwise."""
    return None if held.outcome == "no non-strict export" else Result(scenario, True, f"held export: {held.outcome}")


def export_trace_elsewhere(timeout: float = 60.0) -> Result | None:
    """While thread A is inside ``torch.export.export`` (non-strict: its module's forward runs, and waits
    there), the main thread exports another module from start to end; then A's export goes on. Both must
    export, each with its own module call graph. None where this torch cannot export non-strict."""
    import torch

    if not hasattr(getattr(torch, "export", None), "export"):
        return None
    scenario = "export trace (torch.export.export in two threads at once)"

    class Other(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.other = torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.other(x)

    with _HeldExport(timeout) as held:
        if not held.inside:
            return _export_never_held(held, scenario)
        mine = _export_call_graph(Other())
    theirs = held.outcome
    # Wrong: an export failed, or its call graph names the other thread's module.
    wrong = any(graph.startswith(("raised", "no answer")) for graph in (mine, theirs))
    wrong = wrong or "held" in mine.split(",") or "other" in theirs.split(",")
    detail = f"module call graphs: the main thread's {mine!r}, the held thread's {theirs!r}"
    return Result(scenario, wrong, detail)


def export_builtins_after_overlap(timeout: float = 60.0) -> Result | None:
    """Thread A starts a non-strict export and waits in its forward; thread B starts one and waits too; A
    finishes, then B. Afterwards ``builtins.max`` must be the real builtin again, not one of torch's export
    wrappers (which the scenario then takes away, for the scenarios after it). None where non-strict export
    patches no builtins (before torch 2.8) or cannot run here."""
    import builtins
    import importlib

    try:
        utils = importlib.import_module("torch._export.non_strict_utils")
    except ImportError:
        return None
    if not hasattr(utils, "_override_builtin_ops"):
        return None
    scenario = "export builtins (two non-strict exports overlapping)"
    first = _HeldExport(timeout).__enter__()
    if not first.inside:
        first.__exit__(None, None, None)
        return _export_never_held(first, scenario)
    second = _HeldExport(timeout).__enter__()
    first.__exit__(None, None, None)  # the first to start ends first
    second.__exit__(None, None, None)
    left, depth = builtins.max, 0
    while isinstance(builtins.max, functools.partial):  # torch's wrapper, left behind: unwrap it
        builtins.max = builtins.max.keywords["real_callable"]
        depth += 1
    wrong = not isinstance(left, types.BuiltinFunctionType) or depth > 0
    detail = f"builtins.max afterwards: {type(left).__name__} ({depth} wrappers deep); the exports: "
    return Result(scenario, wrong, detail + f"{first.outcome[:100]!r}, {second.outcome[:100]!r}")


def pre_dispatch_elsewhere(timeout: float = 60.0) -> Result | None:
    """While thread A is inside a non-strict ``torch.export.export`` (pre-dispatch tracing, its forward
    waiting there), the main thread counts the modes on its pre-dispatch stack and runs ``torch.cond``
    eagerly; then A's export goes on. The main thread's stack must be empty, its ``torch.cond`` must run, and
    A must export. None where this torch has no pre-dispatch mode stack or no non-strict export."""
    import torch

    if not hasattr(torch._ops, "_len_torch_dispatch_stack_pre_dispatch") or not hasattr(torch, "cond"):
        return None
    scenario = "pre-dispatch modes (eager torch.cond in one thread while another exports)"
    with _HeldExport(timeout) as held:
        if not held.inside:
            return _export_never_held(held, scenario)
        modes = torch._ops._len_torch_dispatch_stack_pre_dispatch()
        try:
            torch.cond(torch.tensor(True), lambda x: x.sin(), lambda x: x.cos(), (torch.ones(2),))
            cond = "ran"
        except Exception as exc:
            cond = f"raised {type(exc).__name__}: {str(exc)[:200]}"
    wrong = modes != 0 or cond != "ran" or held.outcome.startswith(("raised", "no answer"))
    detail = f"modes on the main thread's stack: {modes}; its torch.cond {cond}; the held export: {held.outcome[:300]}"
    return Result(scenario, wrong, detail)


def _module_slots() -> dict[str, object]:
    """What ``Tracer.trace`` patches on ``nn.Module``: must be the originals again once no trace runs."""
    import torch

    return {name: vars(torch.nn.Module)[name] for name in ("__call__", "__getattr__")}


def h4_trace_patches_leak(action: str, timeout: float = 60.0) -> Result | None:
    """H4: thread A holds a ``symbolic_trace`` of a module open while the main thread does ``action``:

    * ``eager_module``: calls a module eagerly (without the fix it runs A's patched ``Module.__call__``);
    * ``symbolic_trace``: a third thread starts its own trace, held open until A has finished (they overlap
      without nesting: without the fix A reverts B's patcher, B finds ``CURRENT_PATCHER`` None);
    * ``cond``: runs ``torch.cond`` eagerly (it compiles its branches with Dynamo).

    The hazard shows as an error in either thread, a wrong graph, or ``nn.Module`` left patched.
    None for ``cond`` where torch has no ``torch.cond``.
    """
    import torch

    if action == "cond" and not hasattr(torch, "cond"):
        return None
    slots = _module_slots()
    errors: list[str] = []
    graphs: list[list[str]] = []
    held = _HeldTrace("symbolic_trace_module", timeout).__enter__()
    other: _HeldTrace | None = None
    try:
        if action == "eager_module":
            torch.nn.Linear(2, 2)(torch.ones(2))
        elif action == "symbolic_trace":
            other = _HeldTrace("symbolic_trace_module", timeout).__enter__()
        else:
            torch.cond(torch.tensor(True), lambda x: x.sin(), lambda x: x.cos(), (torch.ones(2),))  # 2.2: no builtins
    except Exception as exc:
        errors.append(f"main thread: {exc!r}")
    for trace in (held, other):  # A finishes first
        if trace is not None:
            trace.__exit__(RuntimeError, None, None)  # errors are collected here, not raised
            errors += [f"{trace.thread.name}: {exc!r}" for exc in trace.errors]
            graphs.append(trace.graph_ops)
    wrong = [ops for ops in graphs if ops != MODULE_GRAPH]
    leaked = [name for name, value in _module_slots().items() if value is not slots[name]]
    problems = errors + [f"wrong graph {ops}" for ops in wrong] + [f"nn.Module.{name} left patched" for name in leaked]
    return Result(f"H4 ({action} in one thread while another traces)", bool(problems), "; ".join(problems) or "ok")


def concurrent_tracers(threads: int = 4, rounds: int = 5, timeout: float = 60.0) -> Result:
    """H4 under load: ``threads`` threads ``symbolic_trace`` a module at once, every round; a barrier inside
    the traced code makes all of them be inside their traces together, and they finish in any order.
    """
    slots = _module_slots()
    barrier = threading.Barrier(threads, timeout=timeout)
    problems: list[str] = []

    def in_every_trace(x):
        barrier.wait()
        return x + 1

    def tracer() -> None:
        for _ in range(rounds):
            try:
                ops = _graph_ops(_module_around(in_every_trace))
                if ops != MODULE_GRAPH:
                    problems.append(f"wrong graph {ops}")
            except threading.BrokenBarrierError:
                return  # another thread failed first and broke the barrier; its error is recorded
            except Exception as exc:
                problems.append(repr(exc))
                barrier.abort()
                return

    workers = [threading.Thread(target=tracer, name=f"tracer-{i}", daemon=True) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout)
    if any(worker.is_alive() for worker in workers):
        raise TimeoutError("a tracer thread did not finish")
    problems += [
        f"nn.Module.{name} left patched" for name, value in _module_slots().items() if value is not slots[name]
    ]
    traces = threads * rounds
    detail = f"{len(problems)} problem(s): {'; '.join(problems[:3])}" if problems else f"all {traces} traces correct"
    return Result(f"H4 x{traces} ({threads} threads tracing at once, {rounds} rounds)", bool(problems), detail)


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


class _ObservedLock:
    """Dynamo's ``compile_lock``, noting which threads asked for it before they block on it. It only
    observes: the real lock does the locking. (Looking at the other threads' stacks instead can crash
    torch 2.11 on Python 3.11: a thread in Dynamo's callback sits on top of a frame not started yet.)"""

    def __init__(self, lock: object) -> None:
        self.lock = lock
        self.waiting: set[int] = set()
        self.changed = threading.Condition()

    def __enter__(self) -> object:
        with self.changed:
            self.waiting.add(threading.get_ident())
            self.changed.notify_all()
        return self.lock.__enter__()

    def __exit__(self, *exc_info: object) -> object:
        return self.lock.__exit__(*exc_info)

    def __getattr__(self, name: str) -> object:  # acquire, release, ...
        return getattr(self.lock, name)

    def wait_for(self, threads: list[threading.Thread], timeout: float) -> None:
        """Until every one of ``threads`` has started and then asked for the lock (or ended). A thread not
        started yet is not alive either: without the ``ident`` check it would count as ended."""
        with self.changed:
            self.changed.wait_for(
                lambda: all(t.ident is not None and (t.ident in self.waiting or not t.is_alive()) for t in threads),
                timeout,
            )


@contextlib.contextmanager
def _observed_compile_lock() -> Iterator[_ObservedLock]:
    import importlib

    # The module whose functions take it: convert_frame from torch 2.4, eval_frame before.
    modules = map(importlib.import_module, ("torch._dynamo.convert_frame", "torch._dynamo.eval_frame"))
    module = next(m for m in modules if "compile_lock" in vars(m))
    observed = module.compile_lock = _ObservedLock(module.compile_lock)
    try:
        yield observed
    finally:
        module.compile_lock = observed.lock


def duplicate_compiles(
    threads: int = 3,
    timeout: float = 60.0,
    sizes: tuple[int, ...] | None = None,
    backends: tuple[int, ...] | None = None,
) -> Result:
    """Cold start: one thread compiles a function while ``threads - 1`` others call it. Their cache lookups
    miss, they wait for ``compile_lock``, and then each compiles the same frame again, unless the cache is
    looked up once more after the lock (the first compile is held open until every other thread waits).

    Thread i calls with a tensor of ``sizes[i]`` elements (default 2) through ``torch.compile`` with backend
    number ``backends[i]`` (default 0). A thread whose input or backend differs from every compile before
    it must compile its own; only the others may reuse. Every thread checks its result."""
    import torch

    sizes = sizes or (2,) * threads
    backends = backends or (0,) * threads
    compiled_by: list[str] = []
    first_compile = threading.Event()
    callers: list[threading.Thread] = []
    errors: list[BaseException] = []

    def held_backend(gm, example_inputs):
        compiled_by.append(threading.current_thread().name)
        if len(compiled_by) == 1:
            first_compile.set()
            lock.wait_for(callers, timeout)  # every other thread missed the cache and waits for the lock
        return gm.forward

    def other_backend(gm, example_inputs):  # a backend that is not held_backend (Dynamo compares with ==)
        return held_backend(gm, example_inputs)

    fresh = _fresh_add_one()  # its own cache and recompile limit
    compiled = [torch.compile(fresh, backend=held_backend), torch.compile(fresh, backend=other_backend)]

    def call(size: int, backend: int) -> None:
        try:
            x = torch.arange(float(size))
            if not torch.equal(compiled[backend](x), x + 1):
                raise AssertionError(f"wrong result for {size} elements")
        except BaseException as exc:
            errors.append(exc)

    started = [
        threading.Thread(target=call, args=(sizes[i], backends[i]), name=f"compile-{i}", daemon=True)
        for i in range(threads)
    ]
    first, callers[:] = started[0], started[1:]
    with _observed_compile_lock() as lock:
        first.start()
        if not first_compile.wait(timeout):
            raise TimeoutError("the first thread never started compiling")
        for thread in callers:
            thread.start()
        for thread in started:
            thread.join(timeout)
    if errors:
        raise errors[0]
    needed = len(set(zip(sizes, backends)))
    detail = (
        f"{len(compiled_by)} compiles of one function by {threads} threads starting together "
        f"({needed} different input/backend pair(s))"
    )
    return Result(f"cold start ({threads} threads, one function)", len(compiled_by) > needed, detail)


def _in_thread(fn: Callable[[], object], timeout: float) -> object:
    """``fn()`` run in a new thread: its result, or the exception it raised."""
    box: list[object] = []

    def target() -> None:
        try:
            box.append(fn())
        except Exception as exc:
            box.append(exc)

    thread = threading.Thread(target=target, name="torchfix-selftest")
    thread.start()
    thread.join(timeout)
    return box[0] if box else TimeoutError(f"no answer in {timeout} s")


def h7_cudagraph_trees_in_new_thread(timeout: float = 60.0) -> Result | None:
    """A thread other than the importing one asks for its CUDA graph tree container (what its first
    ``mode="reduce-overhead"`` graph does): torch 2.1 - 2.12 fail in ``get_obj``. Needs no GPU."""
    try:
        from torch._inductor import cudagraph_trees
    except ImportError:
        return None  # torch 2.0: no CUDA graph trees
    main = cudagraph_trees.get_container(0)
    other = _in_thread(lambda: cudagraph_trees.get_container(0), timeout)
    if isinstance(other, BaseException):
        return Result("H7 (CUDA graph trees in a new thread)", True, f"raised {type(other).__name__}: {other}")
    shared = other is main
    return Result("H7 (CUDA graph trees in a new thread)", shared, "shares the main thread's" if shared else "ok")


def _trees_stashed_at_thread_end(make_trees: Callable[[], object], timeout: float) -> BaseException | list[bool]:
    """Run ``make_trees`` in a thread that then ends: what it raised, or whether its tree containers were still
    in torch's C++ thread-local stash when Python dropped the thread's thread-local values (one entry)."""
    import torch

    key, stashed_at_end = "tree_manager_containers", []

    class AtThreadEnd:
        # First used after the trees' own thread-local values (and torchfix's releaser), so dropped after them.
        # Before torch 2.13 an entry cannot be removed, only overwritten with None.
        def __del__(self) -> None:
            stashed_at_end.append(torch._C._is_key_in_tls(key) and torch._C._get_obj_in_tls(key) is not None)

    at_end = threading.local()

    def run() -> None:
        make_trees()
        at_end.probe = AtThreadEnd()

    error = _in_thread(run, timeout)
    return error if isinstance(error, BaseException) else stashed_at_end


def h7_cudagraph_trees_at_thread_end(timeout: float = 60.0) -> Result | None:
    """A thread makes its CUDA graph tree containers (what its first ``mode="reduce-overhead"`` graph does) and
    ends. When Python drops its thread-local values, at the thread's end, the containers must be out of torch's
    C++ thread-local stash: left there, C++ thread-exit code tears the thread's trees down after Python let
    the thread go (torch 2.13 - 2.15; 2.1 - 2.12 give a thread no trees of its own without torchfix). No GPU."""
    try:
        from torch._inductor import cudagraph_trees
    except ImportError:
        return None
    scenario = "H7 (CUDA graph trees at a thread's end)"
    seen = _trees_stashed_at_thread_end(lambda: cudagraph_trees.get_container(0), timeout)
    if isinstance(seen, BaseException):
        return Result(scenario, True, f"no trees of its own: {type(seen).__name__}: {seen}")
    if seen != [False]:
        return Result(scenario, True, f"still in the C++ thread-local stash at the thread's end: {seen}")
    return Result(scenario, False, "taken out of the C++ thread-local stash by the thread")


# The importing thread's containers, kept for the process: without the fix torch 2.1 - 2.12 drop a reference
# to them that they never took, when that thread's C++ state goes.
_importers_trees: list[object] = []


def h7_cudagraph_trees_importer_ends(timeout: float = 60.0) -> Result | None:
    """A worker thread is the first to import CUDA graph trees (as the first thread to compile a
    ``mode="reduce-overhead"`` graph does), and ends. torch stashes the importing thread's containers at import;
    they too must be out of the C++ thread-local stash at the thread's end (up to 2.12 that entry also holds no
    reference of its own, so at the OS thread's exit it drops one from containers Python has freed). Needs a
    process that has not imported CUDA graph trees yet (the hazard tests run it in a fresh one). No GPU."""
    import importlib
    import importlib.util
    import sys

    name = "torch._inductor.cudagraph_trees"
    if name in sys.modules or importlib.util.find_spec(name) is None:
        return None

    def import_trees() -> None:
        _importers_trees.append(importlib.import_module(name).local.tree_manager_containers)

    scenario = "H7 (CUDA graph trees imported by a thread that ends)"
    seen = _trees_stashed_at_thread_end(import_trees, timeout)
    if isinstance(seen, BaseException):
        return Result(scenario, True, f"raised {type(seen).__name__}: {seen}")
    if seen != [False]:
        return Result(scenario, True, f"still in the C++ thread-local stash at the thread's end: {seen}")
    return Result(scenario, False, "taken out of the C++ thread-local stash by the thread")


def h7_cudagraph_step_counters(timeout: float = 60.0) -> Result | None:
    """One thread calls ``torch.compiler.cudagraph_mark_step_begin()`` and a compiled function; the
    generation another thread's CUDA graph trees read must not move (every release up to 2.15). No GPU."""
    import torch

    try:
        from torch._inductor import cudagraph_trees
    except ImportError:
        return None
    compiled = _compiled_add_one()
    manager = cudagraph_trees.CUDAGraphTreeManager
    first_read, acted, seen = threading.Event(), threading.Event(), []

    def read() -> tuple[int, bool]:
        return manager.get_curr_generation(), manager.user_invoked_mark_step()

    def other() -> None:  # a thread with counters of its own (it ran a compiled call), read twice
        compiled(torch.ones(2))
        seen.append(read())
        first_read.set()
        acted.wait(timeout)
        seen.append(read())

    thread = threading.Thread(target=other, name="torchfix-selftest")
    thread.start()
    first_read.wait(timeout)
    torch.compiler.cudagraph_mark_step_begin()
    compiled(torch.ones(2))
    mine = read()
    acted.set()
    thread.join(timeout)
    before, after = (seen + [None, None])[:2]
    moved = before != after
    detail = f"another thread's (generation, mark-step) went {before} -> {after}; the acting thread's: {mine}"
    return Result("H7 (mark-step and compiled call in one thread, CUDA graph generation in another)", moved, detail)


def run_all(timeout: float = 60.0) -> list[Result]:
    """Every scenario the fixes declare (``Fix.scenarios``) that this torch has, in the fixes' order, stage by
    stage: without the fixes, some leave the process broken (a stuck flag, ``nn.Module`` left patched) and
    overlapping exports leave torch's pre-dispatch mode stack dirty, so those run last. A scenario that raises
    because an earlier one broke the process is reported as a failure rather than stopping the report."""
    from . import fixes
    from ._fix import State
    from ._install import status

    applied = {entry.name for entry in status() if entry.state is State.APPLIED}
    declared = [
        scenario
        for fix in fixes.ALL
        for scenario in fix.scenarios
        if not scenario.needs_fix or fix.name in applied  # without its fix, such a scenario can crash torch
    ]
    results = []
    for scenario in sorted(declared, key=lambda s: s.stage):  # stable: the fixes' order within a stage
        try:
            result = globals()[scenario.function](*scenario.args, timeout=timeout)
        except Exception as exc:
            result = Result(scenario.call, True, f"raised {exc!r}")
        if result is not None:
            results.append(result)
    return results
