"""function-mode-stack: the torch-function modes a Dynamo trace sets aside belong to the thread that traces (H13).

A Dynamo trace sets the calling thread's torch-function modes aside while it traces (``TorchFunctionMode``s, and
``with torch.device(...)``, which is one): it enters ``torch._dynamo.variables.torch_function``'s
``torch_function_mode_stack_state_mgr``, which saves the thread's mode stack in its ``stack`` and clears it, and
on exit sets the thread's stack back to what ``stack`` holds. Meanwhile the trace reads ``stack`` as the modes
the traced code runs under (2.12+; they go into the graph and its ``___check_torch_function_mode_stack`` guard),
and puts it back for a moment to build guards (2.12+) or to convert a numpy array (2.6+). That manager is one
object for the process (torch 2.6 - 2.15).

Up to torch 2.8 every Dynamo trace holds ``convert_frame.compile_lock`` while it uses it: "not needed" there.
From 2.9 some traces run without that lock (``convert_frame.fullgraph_capture``): ``torch.compile(...).aot_compile``
and ``torch._dynamo.aot_compile`` enter the manager themselves without it (2.12+, where aot_compile is on by
default). So a thread compiling inside a mode while another thread makes an ``aot_compile`` gets the other thread's
(empty) stack back: its compile fails its own guard (``AssertionError: Guard failed on the same frame it was created
... ___check_torch_function_mode_stack``), the thread has lost its mode, and its ``with`` exit raises ``RuntimeError:
trying to pop from empty mode stack`` (reproduced on 2.13 and 2.15; 2.14.1's source is the same); in the other order
(the ``aot_compile`` enters first, and leaves while the compile is still inside) the ``aot_compile``'s thread ends up
with the compiling thread's mode on its stack, and the compiling thread loses it the same way. Strict
``torch.export`` (2.12+) reads ``stack`` without entering it (no effect seen on 2.13: a strict export beside a
compile inside a mode that turns ``sin`` into ``cos`` kept its ``sin``). On 2.9 - 2.11 only the numpy conversion of
an unlocked trace reads the manager (another thread's modes, for that conversion): read in the source, not
reproduced.

Each thread gets a manager of its own: the global moves to per-thread storage (``torch_function._function_modes_tls``,
:class:`ThreadLocalGlobals`, made by the file's own ``TorchFunctionModeStackStateManager()``); ``convert_frame`` and
``builder``, which import it by name, read the calling thread's (:class:`ImportedNameUses`); ``aot_compile`` imports
it inside the function, at each call, through the module's ``__getattr__``. A plain ``threading.local``
(``seen_in_backward=False``): every trace enters and exits its manager in the thread that traces, and reads it only
there, so nothing of it has to follow a thread into autograd's device thread: a Dynamo trace there (compiled
autograd) enters and exits a manager of that thread's own.
"""

from __future__ import annotations

import importlib
import threading
import types

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result, fresh
from ..patching.patches import ImportedNameUses, ThreadLocalGlobals, moved_global_probe
from ..patching.source import Edit

MODULE = "torch._dynamo.variables.torch_function"
MANAGER, HOLDER = "torch_function_mode_stack_state_mgr", "_function_modes_tls"
CONVERT_FRAME = "torch._dynamo.convert_frame"
# The modules that import the manager by name, at their top.
_BY_NAME = (CONVERT_FRAME, "torch._dynamo.variables.builder")


class _ManagerPerThread(ThreadLocalGlobals):
    """The manager per thread. No function of its own file uses it (its users import it), so there is nothing to
    edit there (``verify`` still proves no global access is left); when the fix goes, the module gets back the
    object that ``convert_frame`` and ``builder`` imported."""

    def __init__(self) -> None:
        super().__init__(
            MODULE,
            MODULE.replace(".", "/") + ".py",
            HOLDER,
            {MANAGER: "manager"},
            own=frozenset({MANAGER}),
            seen_in_backward=False,
        )
        self._original: object = None

    def edits(self, source: str) -> list[Edit]:
        return []

    def describe(self) -> str:
        return super().describe() + "; when removed, the module gets back its own manager"

    def _install_state(self, module: types.ModuleType, source: str) -> None:
        self._original = vars(module)[MANAGER]
        super()._install_state(module, source)

    def _remove_state(self, module: types.ModuleType) -> None:
        super()._remove_state(module)
        vars(module)[MANAGER], self._original = self._original, None


def _patches(_torch_version: str) -> list[ThreadLocalGlobals | ImportedNameUses]:
    return [
        _ManagerPerThread(),
        *(
            ImportedNameUses(module, module.replace(".", "/") + ".py", MODULE, HOLDER, {MANAGER: "manager"})
            for module in _BY_NAME
        ),
    ]


def _probe() -> str | None:
    if not hasattr(importlib.import_module(CONVERT_FRAME), "fullgraph_capture"):
        return (
            "every Dynamo trace holds compile_lock in this torch (no fullgraph_capture, the unlocked trace of "
            "aot_compile and strict export: before torch 2.9), so no two traces share the mode-stack manager"
        )
    return moved_global_probe(MODULE, HOLDER, MANAGER, f"{MODULE} has no {MANAGER}")()


def _sin_plus_one(x):
    return x.sin() + 1


def _cos_plus_one(x):
    return x.cos() + 1


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"


class _CompileInMode:
    """Thread A: a ``torch.compile`` inside a ``TorchFunctionMode``, waiting in its backend (its trace has set its
    modes aside) from ``inside`` until ``release``. ``seen`` gets how it went, and A's modes after its compile."""

    def __init__(self, seen: dict[str, object], timeout: float) -> None:
        import torch

        class PassThrough(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        self.inside, self.release, self.timeout = threading.Event(), threading.Event(), timeout

        def held_backend(gm, example_inputs):
            self.inside.set()
            self.release.wait(timeout)
            return gm.forward

        def compile_in_mode() -> None:
            try:
                with PassThrough():
                    torch.compile(fresh(_sin_plus_one), backend=held_backend)(torch.ones(2))
                    seen["A's modes after its compile"] = torch._C._len_torch_function_stack()
                seen["A's compile"] = "ran"
            except Exception as exc:
                cause = f" (during: {_first_line(exc.__context__)})" if exc.__context__ else ""
                seen["A's compile"] = f"raised {_first_line(exc)}{cause}"
            finally:
                self.inside.set()

        self.thread = threading.Thread(target=compile_in_mode, name="torchfix-selftest", daemon=True)

    def start(self) -> None:
        self.thread.start()
        self.inside.wait(self.timeout)

    def finish(self) -> None:
        self.release.set()
        self.thread.join(self.timeout)


def _aot_compile(backend: object) -> str:
    import torch

    try:
        torch.compile(fresh(_cos_plus_one), fullgraph=True, backend=backend).aot_compile(((torch.ones(2),), {}))
        return "ran"
    except Exception as exc:
        return f"raised {_first_line(exc)}"


def _one_order(main_first: bool, timeout: float) -> str:
    """A's compile inside a mode and the main thread's ``aot_compile``, entering the manager in one order and leaving
    it in the other: what went otherwise than in one thread."""
    import torch

    seen: dict[str, object] = {}
    expected: dict[str, object] = {"A's compile": "ran", "A's modes after its compile": 1}
    if not main_first:
        expected["the main thread's aot_compile"] = "ran"
    expected["the main thread's modes after it"] = 0
    held = _CompileInMode(seen, timeout)
    try:
        if main_first:

            def starting_a(gm, example_inputs):  # A enters after the main thread and stays after it leaves
                held.start()
                return gm.forward

            _aot_compile(starting_a)  # then raises (its callable does not serialize), fix or not
        else:
            held.start()
            seen["the main thread's aot_compile"] = _aot_compile("eager")
        seen["the main thread's modes after it"] = torch._C._len_torch_function_stack()
    finally:
        held.finish()
        while torch._C._len_torch_function_stack():  # A's mode, left here without the fix: off for later scenarios
            torch._C._pop_torch_function_stack()
    wrong = [f"{what}: {seen.get(what, 'none')}" for what, value in expected.items() if seen.get(what) != value]
    return f"{'the main thread' if main_first else 'A'} first: " + ("; ".join(wrong) or "as in one thread")


def function_modes_elsewhere(timeout: float = 60.0) -> Result | None:
    """Thread A compiles inside a ``TorchFunctionMode`` and waits in its backend while the main thread, in no mode,
    makes an ``aot_compile``; then the other order: the main thread's ``aot_compile`` starts A's compile and ends while
    A waits. Each time A's compile must run and leave A inside its mode, and the main thread must end in no mode.
    None where ``aot_compile`` is off by default (before torch 2.12)."""
    import torch

    if not getattr(torch._dynamo.config, "enable_aot_compile", False):
        return None
    parts = [_one_order(main_first, timeout) for main_first in (False, True)]
    return Result(
        "torch-function modes (a compile inside a mode in one thread, an aot_compile in another, both orders)",
        not all(part.endswith("as in one thread") for part in parts),
        " | ".join(parts),
    )


FIX = Fix(
    name="function-mode-stack",
    order=410,
    hazard="a thread compiling inside a TorchFunctionMode (or torch.device context) while another thread "
    "aot_compiles gets the other thread's mode stack back: 'Guard failed on the same frame it was created', its "
    "mode lost, 'trying to pop from empty mode stack'",
    versions=releases("2.9"),
    probe=_probe,
    patches=_patches,
    trigger="torch._dynamo",
    scenarios=(
        Scenario(
            function_modes_elsewhere,
            releases("2.12"),
            needs="aot_compile on by default (torch 2.12+)",
            shows="pop from empty mode stack",
        ),
    ),
    shared_state="torch._dynamo.variables.torch_function.torch_function_mode_stack_state_mgr: one object whose "
    "stack every Dynamo trace saves the thread's torch-function modes in (torch.compile under compile_lock, "
    "aot_compile without it), reads as the traced code's modes, and sets back on the thread at its end",
    symptom="torch 2.13, 2.14.1 and 2.15: a thread compiling inside a TorchFunctionMode (or a torch.device context) "
    "while another thread aot_compiles: AssertionError 'Guard failed on the same frame it was created ... "
    "___check_torch_function_mode_stack', the mode gone from that thread, and its with-exit raises 'RuntimeError: "
    "trying to pop from empty mode stack'; in the other order the aot_compiling thread is left with the other's mode "
    "on its stack (both, 5 of 5 runs on 2.13 and on 2.15)",
    releases_note='before 2.9: "not needed" (every trace holds compile_lock); 2.9 - 2.11: only the numpy conversion '
    "of an unlocked trace reads it (read, not reproduced; aot_compile is off by default); 2.12 - 2.15: aot_compile "
    "and strict export use it without the lock",
    survey_rows=("torch/_dynamo/variables/torch_function.py: torch_function_mode_stack_state_mgr",),
)
