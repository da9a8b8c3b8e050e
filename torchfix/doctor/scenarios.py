"""The scenario kit: what the fixes' self-test scenarios are made of (the doctor runs them: ``selftest``).

Each fix declares its scenarios (``Fix.scenarios``) and defines their functions in its own module. A scenario
forces the bad interleaving with events (one thread holds a trace open while another thread acts), so it
shows the hazard every time on a torch that has it, and never on one that does not. It returns a
:class:`Result`: ``hazard`` says whether the hazard showed, ``detail`` what was seen. Run them in a process you
can throw away: on an unpatched torch, some leave the process broken (H2: the FX flag stuck True).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from ..patching.source import ShapeError

NESTED_TRACE_ERROR = "Detected that you are using FX to symbolically trace a dynamo-optimized function"


@dataclass(frozen=True)
class Result:
    """What one run of a scenario saw: whether the hazard showed, and the detail."""

    scenario: str
    hazard: bool
    detail: str


def _add_one(x):
    return x + 1


def fresh(function: Callable) -> Callable:
    """``function`` with a code object of its own: Dynamo keeps compiled code on the code object, so a scenario
    compiling it meets nothing an earlier scenario (or an earlier run of itself) compiled."""
    code, closure = function.__code__.replace(), function.__closure__
    return types.FunctionType(code, function.__globals__, function.__name__, function.__defaults__, closure)


def fresh_add_one() -> Callable:
    return fresh(_add_one)


def compiled_add_one() -> Callable:
    import torch

    compiled = torch.compile(fresh_add_one(), backend="eager")
    compiled(torch.ones(2))  # compiled before any trace starts (Dynamo captures its predicate here)
    return compiled


def counting_compile(function: Callable, backend: str) -> tuple[Callable, Callable[[], int]]:
    """``torch.compile(function, backend=backend)``, and how often the calling thread has run the graphs it compiled
    to: a call that runs none ran eagerly."""
    import torch
    from torch._dynamo.backends.registry import lookup_backend

    runs = threading.local()

    def counting(gm, example_inputs):
        compiled = lookup_backend(backend)(gm, example_inputs)

        def run(*args):
            runs.count = getattr(runs, "count", 0) + 1
            return compiled(*args)

        return run

    return torch.compile(function, backend=counting), lambda: getattr(runs, "count", 0)


def call_compiled(compiled: Callable) -> str | None:
    """Call a compiled function; the nested-trace error's message if it raised it."""
    import torch

    try:
        compiled(torch.ones(2))
    except RuntimeError as exc:
        if NESTED_TRACE_ERROR in str(exc):
            return str(exc)
        raise
    return None


# The graph symbolic_trace must make of module_around: x + 1, then the Linear as a leaf module.
MODULE_GRAPH = ["placeholder", "call_function", "call_module", "output"]


def module_around(inner: Callable):
    """A module whose forward runs ``inner`` (traced through) and then a submodule (a leaf)."""
    import torch

    class Around(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.linear(inner(x))

    return Around()


def fx_node_stack_traces() -> list[str]:
    """One thread: the node stack traces of a ``torch.fx.Tracer`` trace, with ``record_stack_traces``, of a module
    that calls a submodule (under ``trace-patch-isolation``, ``nn.Module.__call__`` is torchfix's dispatcher while
    a thread traces, so a submodule's nodes are recorded through it)."""
    import torch

    class Inner(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x)

    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Inner()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) + 1

    tracer = torch.fx.Tracer()
    tracer.record_stack_traces = True
    return [node.stack_trace or "" for node in tracer.trace(Outer()).nodes]


def graph_ops(module) -> list[str]:
    import torch

    return [node.op for node in torch.fx.symbolic_trace(module).graph.nodes]


class HeldTrace:
    """A thread inside ``Tracer.trace`` (``symbolic_trace`` of a function, ``symbolic_trace_module``
    of a module with a submodule, ``make_fx``), or inside a ``torch.compile`` (``"compile"``: its backend
    holds the compile open), until released.

    ``with HeldTrace(...):`` returns once the thread is inside the traced function (or the backend),
    and lets the trace finish on exit. ``seen_inside`` holds what ``probe`` returned in there;
    ``graph_ops`` the node kinds of a ``symbolic_trace_module`` graph.
    """

    def __init__(self, tracer: str, timeout: float, probe: Callable[[], object] | None = None) -> None:
        self.tracer, self.timeout, self.probe = tracer, timeout, probe
        # inside: set when the thread is inside, or has ended without getting there (got_inside False).
        self.inside, self.release = threading.Event(), threading.Event()
        self.got_inside = False
        self.errors: list[BaseException] = []
        self.seen_inside: list[object] = []
        self.graph_ops: list[str] = []
        self.thread = threading.Thread(target=self._run, name=f"held-{tracer}", daemon=True)

    def _hold(self) -> None:
        if self.probe is not None:
            self.seen_inside.append(self.probe())
        self.got_inside = True
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
                self.graph_ops = graph_ops(module_around(held_open))
            elif self.tracer == "make_fx":
                make_fx(held_open)(torch.ones(2))
            else:
                # A code object of its own: on 2.2 a cached entry of an earlier run, guarded on another backend,
                # fails its guard in this thread (the hazard of guarded-backends).
                torch.compile(fresh_add_one(), backend=held_backend)(torch.ones(2))
        except BaseException as exc:  # reported by __exit__
            self.errors.append(exc)
        finally:  # where it never got inside (a flag left stuck makes the trace raise), __enter__ waits no longer
            self.inside.set()

    def __enter__(self) -> HeldTrace:
        self.thread.start()
        if not self.inside.wait(self.timeout) or not self.got_inside:
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


def export_call_graph(module: object) -> str:
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


class HeldExport:
    """A thread inside a non-strict ``torch.export.export`` of a module (its submodule named ``held``) whose
    forward waits there, until released. ``with HeldExport(timeout) as held:`` returns once the thread is
    inside the forward, or gave up (``held.inside`` False); on exit the export goes on, and ``held.outcome``
    is what :func:`export_call_graph` made of it."""

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
            target=lambda: self.answers.append(export_call_graph(module)), name="torchfix-selftest", daemon=True
        )

    @property
    def inside(self) -> bool:
        return self.entered.is_set()

    @property
    def outcome(self) -> str:
        return self.answers[0] if self.answers else "no answer"

    def __enter__(self) -> HeldExport:
        self.thread.start()
        if not self.entered.wait(self.timeout):
            self.thread.join(self.timeout)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release.set()
        self.thread.join(self.timeout)


def export_never_held(held: HeldExport, scenario: str) -> Result | None:
    """The result of a scenario whose export never reached its forward: None where torch has no non-strict
    export, a failure otherwise."""
    return None if held.outcome == "no non-strict export" else Result(scenario, True, f"held export: {held.outcome}")


@contextlib.contextmanager
def held_elsewhere(
    settings: Sequence[Callable[[], AbstractContextManager]], own_view: Callable[[], None], timeout: float
) -> Iterator[bool]:
    """Another thread enters each of ``settings`` (the save/set/restore contexts under test), calls ``own_view()``
    there (to record what it sees of its own settings) and stays inside until this ``with`` block ends: the block
    runs while another thread holds the settings. Yields whether that thread got inside in time."""
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with contextlib.ExitStack() as entered:
                for setting in settings:
                    entered.enter_context(setting())
                own_view()
                inside.set()
                release.wait(timeout)
        finally:
            inside.set()

    thread = threading.Thread(target=hold, name="torchfix-selftest", daemon=True)
    thread.start()
    try:
        yield inside.wait(timeout)
    finally:
        release.set()
        thread.join(timeout)


def torch_module(name: str) -> types.ModuleType | None:
    """The torch module ``name``, imported; None where this release does not have it (its scenario returns None)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        return None


def in_thread(fn: Callable[[], object], timeout: float) -> object:
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


def line_of(function: types.FunctionType, text: str) -> int:
    """The line of ``function``'s file on which its first statement starting with ``text`` is."""
    lines, first = inspect.getsourcelines(function)
    found = next((first + i for i, line in enumerate(lines) if line.strip().startswith(text)), None)
    if found is None:
        raise ShapeError(f"{function.__qualname__} has no line `{text}...`")
    return found


# A stop: run when the traced function reaches its line. It may block, to hold the thread there while other
# threads go on. It returns False to stay armed (the frame was not the one it waits for), anything else once done.
Stop = Callable[[types.FrameType], "bool | None"]


def stopping(function: types.FunctionType, stops: dict[int, Stop], call: Callable[[], object]) -> object:
    """``call()``, with a line-trace hook on the calling thread only that runs ``stops[line](frame)`` when
    ``function``'s code reaches one of those lines of its file. Torch's code is not touched."""
    code = function.__code__

    def on_line(frame: types.FrameType, event: str, _arg: object) -> Callable:
        stop = stops.get(frame.f_lineno) if event == "line" else None
        if stop is not None and stop(frame) is not False:
            del stops[frame.f_lineno]
        return on_line

    def on_call(frame: types.FrameType, _event: str, _arg: object) -> Callable | None:
        same = frame.f_code.co_name == code.co_name and frame.f_code.co_filename == code.co_filename
        return on_line if same else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        return call()
    finally:
        sys.settrace(previous)


def hold(reached: threading.Event, release: threading.Event, timeout: float) -> Stop:
    """A stop that says it was reached and waits to be released."""

    def stop(_frame: types.FrameType) -> None:
        reached.set()
        release.wait(timeout)

    return stop


def started_thread(
    name: str, target: Callable[[], object], ended: threading.Event, errors: dict[str, str]
) -> threading.Thread:
    """A started thread running ``target``; what it raises goes to ``errors[name]``, and ``ended`` is set when it ends
    (so that a wait for a point it never reaches ends too)."""

    def run() -> None:
        try:
            target()
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
        finally:
            ended.set()

    thread = threading.Thread(target=run, name=f"torchfix-selftest-{name}", daemon=True)
    thread.start()
    return thread
