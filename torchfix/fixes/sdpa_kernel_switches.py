"""sdpa-kernel-switches: ``torch.nn.attention.sdpa_kernel`` is a counted override that undoes only itself.

``sdpa_kernel(backends, set_priority=False)`` (torch 2.3+; ``torch.backends.cuda.sdp_kernel`` enters it too) saves
the SDPA backend switches (flash, mem_efficient, math, from 2.4 cudnn, from 2.9 overrideable; with
``set_priority``, 2.6+, the priority order), sets them, and writes back what it saved at its end. The switches
are C++ settings, one per process (``torch._C._set_sdp_use_*``), which every ``scaled_dot_product_attention`` of
every thread reads:

* two contexts in two threads that end out of order leave the second one's saved state, the first's backends, on
  for good (``sdpa_kernel(MATH)`` left so: the process is math-only);
* the end writes back every switch, undoing a backend another thread enabled or disabled meanwhile;
* while one thread is inside, every thread's SDPA uses its backends: a training thread's SDPA with dropout raises
  ``RuntimeError: No available kernel`` while an evaluation thread is inside ``sdpa_kernel(FLASH_ATTENTION)``
  (torch 2.13, 2.14.1, measured), and a graph compiled meanwhile keeps that choice (``compile-switch-view``).

Its saving and restoring go through :class:`torchfix.patching.switches.Override` instead: the switches it sets are
counted across threads, and its end takes them back only where they still hold the value it set. Out of reach: the third
point, in eager code (one C++ setting, read by the operator whichever thread calls it; the window is the user's
``with`` block). In one thread ``sdpa_kernel`` sets and restores what torch does, nested ones too, but for two
cases: a switch the context did not change (it found the value it sets) and that is changed inside it keeps that
change after it; and with ``set_priority`` (2.8+) the priority order is written back as it was found, where
torch rebuilds it from the backends that were enabled (the same order unless some were disabled). Not covered: an
``sdpa_kernel`` inside compiled code, which Dynamo traces and replays itself (``torch.nn.attention._sdpa_kernel``
with the backends it found when it compiled, torch's behaviour in one thread too).
"""

from __future__ import annotations

import ast
import importlib
import sys
import threading

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result, torch_module
from ..patching.patches import SourcePatch, source_without_import
from ..patching.source import Edit, ShapeError, definition, replace_node
from ..patching.switches import Override, Switch

MODULE, FUNCTION = "torch.nn.attention", "sdpa_kernel"
OVERRIDE = "_torchfix_sdpa_override"
# The backends' names in torch._C (_get_<name>_sdp_enabled, _set_sdp_use_<name>) and in SDPBackend; torch 2.6+ has
# this table itself (_backend_names), the releases before it name each backend's enable_<name>_sdp.
BACKENDS = {
    "cudnn": "CUDNN_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "mem_efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
    "overrideable": "OVERRIDEABLE",
}


def _backend_switches() -> dict[str, Switch]:
    """The switches this release's ``sdpa_kernel`` sets, by their SDPBackend name, in the order torch sets them."""
    import torch

    module = importlib.import_module(MODULE)
    table = getattr(module, "_backend_names", None) or {
        name: attr for name, attr in BACKENDS.items() if f"enable_{name}_sdp" in vars(module)
    }
    c = torch._C
    return {
        attr: Switch(f"sdp.{name}", getattr(c, f"_get_{name}_sdp_enabled"), getattr(c, f"_set_sdp_use_{name}"))
        for name, attr in table.items()
    }


class _SdpaOverride:
    """``_torchfix_sdpa_override(backends, set_priority)``: the override ``sdpa_kernel`` enters (not entered yet)."""

    def __init__(self) -> None:
        import torch

        self._backends = _backend_switches()  # raises here, at apply, where torch lacks a switch
        self._sdp_backend = importlib.import_module(MODULE).SDPBackend
        c = torch._C
        self._priority = (
            Switch("sdp.priority_order", c._get_sdp_priority_order, c._set_sdp_priority_order)
            if hasattr(c, "_set_sdp_priority_order")
            else None
        )

    def __call__(self, backends: object, set_priority: bool) -> Override:
        return Override(lambda: self._values(backends, set_priority))

    def _values(self, backends: object, set_priority: bool) -> dict[Switch, object]:
        """What torch's sdpa_kernel sets: each backend on if named, and with ``set_priority`` the named ones first, in
        their order, then the others in the order they had."""
        values: dict[Switch, object] = {
            switch: getattr(self._sdp_backend, attr) in backends for attr, switch in self._backends.items()
        }
        if set_priority:
            first = list(dict.fromkeys(int(backend) for backend in backends))
            values[self._priority] = first + [int(b) for b in self._priority.get() if b not in first]
        return values


def _is_setter(node: ast.AST) -> bool:
    """A statement of sdpa_kernel that sets switches: ``_sdpa_kernel(...)``, ``enable_<name>_sdp(...)`` (2.3 -
    2.5) or ``torch._C._set_sdp_priority_order(...)`` (2.6 - 2.7)."""
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
        return False
    func = node.value.func
    if isinstance(func, ast.Name):
        return func.id == "_sdpa_kernel" or (func.id.startswith("enable_") and func.id.endswith("_sdp"))
    return isinstance(func, ast.Attribute) and func.attr == "_set_sdp_priority_order"


class _CountedSdpaKernel(SourcePatch):
    def __init__(self) -> None:
        super().__init__(MODULE, "torch/nn/attention/__init__.py")

    def describe(self) -> str:
        return super().describe() + f"; adds {OVERRIDE}, a counted override of the SDPA switches (_switches)"

    def edits(self, source: str) -> list[Edit]:
        """The save (``previous_backends = _cur_sdpa_kernel_backends(...)``, before 2.6 ``previous_math: bool =
        math_sdp_enabled()``) becomes the override; the first setter that the ``try`` runs unconditionally enters it,
        the first in the ``finally`` exits it; the other setters (2.6 - 2.7: the priority's, under ``if
        set_priority:``) become ``pass``."""
        function = definition(source, self.relpath, FUNCTION)
        saves = [
            node
            for node in function.body
            if isinstance(node, (ast.Assign, ast.AnnAssign))
            and isinstance(node.value, ast.Call)
            and ast.unparse(node.value.func) in ("_cur_sdpa_kernel_backends", "math_sdp_enabled")
        ]
        tries = [node for node in function.body if isinstance(node, ast.Try)]
        if len(saves) != 1 or len(tries) != 1:
            raise ShapeError(f"{self.relpath}: {FUNCTION} is not one save of the backends and one try")
        save, block = saves[0], tries[0]
        name = save.target.id if isinstance(save, ast.AnnAssign) else save.targets[0].id
        priority = "set_priority" if any(arg.arg == "set_priority" for arg in function.args.args) else "False"
        edits = [replace_node(save.value, f"{OVERRIDE}(backends, {priority})")]
        for body, call in ((block.body, f"{name}.enter()"), (block.finalbody, f"{name}.exit()")):
            unconditional = next((statement for statement in body if _is_setter(statement)), None)
            if unconditional is None:
                raise ShapeError(f"{self.relpath}: {FUNCTION} sets no switch unconditionally in a part of its try")
            setters = [node for statement in body for node in ast.walk(statement) if _is_setter(node)]
            edits += [replace_node(node, call if node is unconditional else "pass") for node in setters]
        return edits

    def helpers(self) -> dict[str, object]:
        return {OVERRIDE: _SdpaOverride()}


def _probe() -> str | None:
    source = source_without_import(MODULE)
    if source is None or f"def {FUNCTION}(" not in source:
        return f"{MODULE} has no {FUNCTION} (before torch 2.3)"
    module = sys.modules.get(MODULE)
    return "its overrides are counted already" if module is not None and OVERRIDE in vars(module) else None


def _switches_now() -> dict[str, bool]:
    return {name: bool(switch.get()) for name, switch in _backend_switches().items()}


def _held_in_thread(backends: object, timeout: float) -> tuple[threading.Event, threading.Thread]:
    """A thread inside ``sdpa_kernel(backends)`` (this returns once it is) until the event it returns is set."""
    attention = importlib.import_module(MODULE)
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:
        with attention.sdpa_kernel(backends):
            inside.set()
            release.wait(timeout)

    thread = threading.Thread(target=hold, name="torchfix-selftest", daemon=True)
    thread.start()
    inside.wait(timeout)
    return release, thread


def sdpa_kernels_elsewhere(timeout: float = 60.0) -> Result | None:
    """Thread A enters ``sdpa_kernel(MATH)``, then thread B ``sdpa_kernel(FLASH_ATTENTION)``; A ends first, then B:
    every switch must be as before. Then A enters ``sdpa_kernel([FLASH_ATTENTION, MATH])``, the main thread turns
    flash off (``enable_flash_sdp(False)``), A ends: flash must stay off. None before torch 2.3."""
    attention = torch_module(MODULE)
    if attention is None or not hasattr(attention, FUNCTION):
        return None
    import torch

    backend = attention.SDPBackend
    before, problems = _switches_now(), []
    a, a_thread = _held_in_thread(backend.MATH, timeout)
    b, b_thread = _held_in_thread(backend.FLASH_ATTENTION, timeout)
    for release, thread in ((a, a_thread), (b, b_thread)):  # A ends first
        release.set()
        thread.join(timeout)
    changed = [name for name, enabled in _switches_now().items() if enabled != before[name]]
    if changed:
        problems.append(f"left changed: {', '.join(changed)}")
        for name in changed:
            _backend_switches()[name].set(before[name])
    a, a_thread = _held_in_thread([backend.FLASH_ATTENTION, backend.MATH], timeout)
    torch.backends.cuda.enable_flash_sdp(False)
    a.set()
    a_thread.join(timeout)
    if torch.backends.cuda.flash_sdp_enabled():
        problems.append("enable_flash_sdp(False) made meanwhile was undone")
    torch.backends.cuda.enable_flash_sdp(before["FLASH_ATTENTION"])
    return Result(
        "SDPA backend switches (sdpa_kernel in two threads, ending out of order; a setting made meanwhile)",
        bool(problems),
        "; ".join(problems) or "switches as before, the setting made meanwhile kept",
    )


FIX = Fix(
    name="sdpa-kernel-switches",
    order=420,
    hazard="sdpa_kernel in two threads that end out of order leaves the process with one's backends (math-only) "
    "for good, and its end undoes SDPA backend settings another thread made meanwhile",
    versions=releases("2.3"),
    probe=_probe,
    patches=lambda _torch_version: [_CountedSdpaKernel()],
    trigger=MODULE,
    shared_state="the SDPA backend switches (torch._C._set_sdp_use_flash / mem_efficient / math / cudnn / "
    "overrideable, and the priority order), one C++ setting each per process: sdpa_kernel saves, sets and writes "
    "them back; every scaled_dot_product_attention reads them, whichever thread runs it",
    symptom="two sdpa_kernel contexts in two threads that end out of order leave the first one's backends on for "
    "good (the process math-only); the end of one undoes a backend another thread enabled or disabled meanwhile "
    "(the scenario without the fix: 5 of 5 runs on torch 2.10, 2.13 and 2.15; with it 0 of 5 each); while one "
    "thread is inside sdpa_kernel(FLASH_ATTENTION), another thread's SDPA with dropout raises RuntimeError: No "
    "available kernel (torch 2.13, 2.14.1; with the fix too: one C++ setting)",
    releases_note='2.3 - 2.15 (no sdpa_kernel before 2.3: "not needed")',
    scenarios=(Scenario(sdpa_kernels_elsewhere, releases("2.3"), needs="sdpa_kernel (2.3+)", shows="left changed"),),
    survey_rows=(
        "torch/nn/attention/__init__.py: sdpa_kernel (C++ SDPA switches _set_sdp_use_*, _set_sdp_priority_order)",
    ),
)
