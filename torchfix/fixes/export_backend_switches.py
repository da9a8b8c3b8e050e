"""export-backend-switches: an export's ``set_flags(False)`` of mkldnn, nnpack and cudnn is counted, and undoes
only itself.

``torch.export._trace._ignore_backend_decomps()`` (torch 2.3+) turns the oneDNN (mkldnn) and NNPACK backends off
with ``torch.backends.<name>.set_flags(False)``, cuDNN too from 2.11, so that the graph an export traces holds
torch's generic operators rather than a backend's own; at its end it calls ``set_flags(*saved)`` with the whole
tuple it saved. Every export enters it around its trace (Dynamo's capture, the AOT export, the non-strict
``make_fx``), and so does ``ExportedProgram.run_decompositions()``. The switches are C++ settings, one per process:

* two exports that overlap in two threads leave all three backends off for the rest of the process when the first
  to start ends first (the second writes back the "off" it found);
* the exit writes back every setting of each saved tuple (``deterministic``, ``benchmark``, ``allow_tf32``, the
  fp32 precision...), undoing a ``torch.backends.cudnn.deterministic = True`` another thread set meanwhile;
* while any thread exports, every other thread runs without oneDNN and cuDNN (torch 2.13 and 2.14.1, measured).

The calls go through :class:`torchfix.patching.switches.Override` instead: ``set_flags(False)`` becomes an override of
the switches it sets (``enabled``, and from 2.10 the fp32 precision, which ``set_flags`` sets to its default
"none"), counted across threads, and the exit takes back those alone, where they still hold what the override
set. Out of reach: the third point. The backends read one C++ setting whichever thread runs an operator, and the
window is already as narrow as torch can make it, the traces themselves (their operators' decompositions pick the
backend as they dispatch). A graph another thread compiles meanwhile is traced with those backends off too: the
compile and the export are both traces that need the switch at once (``compile-switch-view`` leaves an export's
switches alone). In one thread the export sets and restores what torch does, but for a setting of the saved
tuple the export does not change: one its own module's forward makes while it is traced stays after the export.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import HeldExport, Result, export_never_held, torch_module
from ..patching.patches import SourcePatch, source_without_import
from ..patching.source import Edit, ShapeError, definition, replace_node
from ..patching.switches import Override, Switch

MODULE, FUNCTION = "torch.export._trace", "_ignore_backend_decomps"
OFF = "_torchfix_backend_off"
# Each backend's fp32 precision, which set_flags sets (torch 2.10+): the backend name torch._C calls it by.
PRECISION_BACKEND = {"mkldnn": "mkldnn", "cudnn": "cuda"}


def _off_values(backend: str) -> dict[Switch, object]:
    """The switches ``torch.backends.<backend>.set_flags(False)`` sets, with the values it sets them to: ``enabled``,
    and every argument whose default is not None (only ``_fp32_precision``, "none", in 2.10 - 2.15)."""
    import torch

    c = torch._C
    parameters = inspect.signature(importlib.import_module(f"torch.backends.{backend}").set_flags).parameters
    enabled = Switch(f"{backend}.enabled", getattr(c, f"_get_{backend}_enabled"), getattr(c, f"_set_{backend}_enabled"))
    values: dict[Switch, object] = {enabled: False}
    for name, parameter in parameters.items():
        if name == "_enabled" or parameter.default is None:
            continue
        if name != "_fp32_precision" or backend not in PRECISION_BACKEND:
            raise ShapeError(f"torch.backends.{backend}.set_flags sets {name} too, which torchfix does not know")
        of = PRECISION_BACKEND[backend]
        switch = Switch(
            f"{backend}.fp32_precision",
            lambda of=of: c._get_fp32_precision_getter(of, "all"),
            lambda value, of=of: c._set_fp32_precision_setter(of, "all", value),
        )
        values[switch] = parameter.default
    return values


class _BackendOff:
    """``_torchfix_backend_off(name)``: an entered override of what ``set_flags(False)`` of that backend sets."""

    def __init__(self, backends: list[str]) -> None:
        self._values = {backend: _off_values(backend) for backend in backends}  # raises here, at apply, if unknown

    def __call__(self, backend: str) -> Override:
        return Override(lambda: self._values[backend], yields_to_compiles=False).enter()


class _CountedBackendsOff(SourcePatch):
    def __init__(self) -> None:
        super().__init__(MODULE, "torch/export/_trace.py")

    def describe(self) -> str:
        return super().describe() + f"; adds {OFF}, a counted override of what set_flags(False) sets (_switches)"

    def edits(self, source: str) -> list[Edit]:
        """In ``_ignore_backend_decomps``: ``torch.backends.X.set_flags(False)`` -> ``_torchfix_backend_off("X")``,
        and ``torch.backends.X.set_flags(*saved)`` -> ``saved.exit()``."""
        function = definition(source, self.relpath, FUNCTION)
        edits, saved = [], {}
        for node in ast.walk(function):
            if isinstance(node, ast.Assign) and self._backend(node.value, off=True) is not None:
                saved[node.targets[0].id] = self._backend(node.value, off=True)
                edits.append(replace_node(node.value, f'{OFF}("{saved[node.targets[0].id]}")'))
        for node in ast.walk(function):
            if isinstance(node, ast.Call) and self._backend(node, off=False) is not None:
                name = node.args[0].value.id
                if saved.get(name) != self._backend(node, off=False):
                    raise ShapeError(f"{self.relpath} line {node.lineno}: set_flags(*{name}) of another backend")
                edits.append(replace_node(node, f"{name}.exit()"))
        if not saved or len(edits) != 2 * len(saved):
            raise ShapeError(f"{self.relpath}: {FUNCTION} is not set_flags(False) ... set_flags(*saved) per backend")
        return edits

    @staticmethod
    def _backend(node: ast.AST, off: bool) -> str | None:
        """X of ``torch.backends.X.set_flags(False)`` (``off``) or of ``torch.backends.X.set_flags(*name)``."""
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "set_flags"):
            return None
        owner = node.func.value
        if not (isinstance(owner, ast.Attribute) and ast.unparse(owner.value) == "torch.backends"):
            return None
        args = node.args
        if off:
            matches = len(args) == 1 and isinstance(args[0], ast.Constant) and args[0].value is False
        else:
            matches = len(args) == 1 and isinstance(args[0], ast.Starred) and isinstance(args[0].value, ast.Name)
        return owner.attr if matches and not node.keywords else None

    def helpers(self) -> dict[str, object]:
        function = definition(source_without_import(MODULE) or "", self.relpath, FUNCTION)
        return {OFF: _BackendOff([b for node in ast.walk(function) if (b := self._backend(node, off=True))])}


def _probe() -> str | None:
    source = source_without_import(MODULE)
    if source is None or f"def {FUNCTION}(" not in source:
        return f"{MODULE} has no {FUNCTION} (before torch 2.3)"
    module = sys.modules.get(MODULE)
    return "its overrides are counted already" if module is not None and OFF in vars(module) else None


def _backends_now() -> dict[str, bool]:
    import torch

    return {
        "mkldnn": torch.backends.mkldnn.enabled,
        "nnpack": torch._C._get_nnpack_enabled(),
        "cudnn": torch.backends.cudnn.enabled,
    }


def overlapping_exports(timeout: float = 60.0) -> Result | None:
    """Threads A and B each export (non-strict) a module whose forward waits; B starts while A traces, then the main
    thread sets ``torch.backends.cudnn.deterministic = True``, and A finishes first. Afterwards mkldnn, nnpack and
    cudnn must be enabled as before, and ``deterministic`` must be True. What the main thread saw of mkldnn while
    the exports ran is reported, not judged (one C++ setting: out of reach). None where torch has no
    ``_ignore_backend_decomps`` (before 2.3) or cannot export non-strict."""
    import torch

    if not hasattr(torch_module(MODULE), FUNCTION):
        return None
    scenario = "export backend switches (two threads' exports overlapping, a setting made meanwhile)"
    before, deterministic = _backends_now(), torch.backends.cudnn.deterministic
    first, second = HeldExport(timeout), HeldExport(timeout)
    try:
        first.__enter__()
        if not first.inside:
            return export_never_held(first, scenario)
        second.__enter__()
        seen_inside = _backends_now()["mkldnn"]
        torch.backends.cudnn.deterministic = True
    finally:
        first.__exit__(None, None, None)  # A ends first
        second.__exit__(None, None, None)
    after, kept = _backends_now(), torch.backends.cudnn.deterministic
    left_off = [name for name, enabled in after.items() if enabled != before[name]]
    problems = [f"left off: {', '.join(left_off)}"] if left_off else []
    problems += [] if kept else ["torch.backends.cudnn.deterministic = True set meanwhile was undone"]
    problems += [f"an export {outcome}" for outcome in (first.outcome, second.outcome) if outcome.startswith("raised")]
    # Put torch back for the scenarios after this one.
    torch.backends.mkldnn.enabled, torch.backends.cudnn.enabled = before["mkldnn"], before["cudnn"]
    torch._C._set_nnpack_enabled(before["nnpack"])
    torch.backends.cudnn.deterministic = deterministic
    detail = "; ".join(problems) or "switches as before, the setting made meanwhile kept"
    return Result(scenario, bool(problems), f"{detail} (mkldnn enabled in the main thread meanwhile: {seen_inside})")


FIX = Fix(
    name="export-backend-switches",
    order=410,
    hazard="exports in two threads leave mkldnn, nnpack and cudnn off for good, and an export's end undoes backend "
    "settings (cudnn.deterministic) that another thread made meanwhile",
    versions=releases("2.3"),
    probe=_probe,
    patches=lambda _torch_version: [_CountedBackendsOff()],
    trigger=MODULE,
    shared_state="the C++ switches torch.backends.mkldnn/nnpack/cudnn.set_flags set (enabled, fp32 precision, "
    "deterministic, ...), one per process: every export and run_decompositions() sets mkldnn, nnpack (and cudnn) off "
    "for its trace with set_flags(False) and writes back the whole saved tuple; every operator reads them",
    symptom="two exports that overlap leave oneDNN and NNPACK (from 2.11 cuDNN too) off for the rest of the process, "
    "and from 2.11 a torch.backends.cudnn.deterministic = True another thread sets meanwhile is undone at the "
    "export's end (the scenario without the fix: 5 of 5 runs on torch 2.13 and 2.15, 3 of 3 on 2.10; with it 0 of 5, "
    "0 of 5, 0 of 4); while any thread exports, every thread runs without oneDNN/cuDNN (not fixable: one C++ setting)",
    releases_note='2.3 - 2.15 (no _ignore_backend_decomps before 2.3: "not needed"; cudnn too from 2.11)',
    scenarios=(
        Scenario(
            overlapping_exports,
            releases("2.4"),
            needs="non-strict export",
            shows="left off: mkldnn, nnpack",
            stage=3,
            # Two exports at once: FakeTensorMode.__enter__ segfaults there (2.10: 1 of the first 2 runs in one process)
            crashes=releases("2.10", "2.11"),
        ),
    ),
    survey_rows=(
        "torch/export/_trace.py: _ignore_backend_decomps (C++ switches of torch.backends.mkldnn / nnpack / cudnn)",
    ),
)
