"""stack-filters: torch's stack filters take torchfix's frames for torch's own, as they were before torchfix.

torch keeps user stack traces of what it records (each FX node's ``stack_trace``, the user frame of a guard or a
data-dependent error, structured logs) by dropping its own frames: those whose file is in
``torch._dynamo.guards.uninteresting_files()`` (and, before 2.6, ``symbolic_shapes.uninteresting_files()``,
which from 2.6 unions it). A few of torchfix's functions stand between torch's code and the code it calls: the
per-thread dispatcher of ``trace-patch-isolation`` in ``nn.Module.__call__`` while a thread traces, the lock
around ``torch.export.save``'s pickling. torch does not know their file, so a stack trace recorded through them
showed one frame of torchfix: ``symbolic_trace`` with ``record_stack_traces`` gave every node under a submodule
call a ``torchfix/patching/slots.py ... in dispatch`` line (torch 2.13, one thread).

The edit adds torchfix's own files to the set ``torch._dynamo.guards.uninteresting_files()`` returns, so every
filter built on it drops them as it drops torch's; torch 2.1 - 2.5, whose FX set does not union Dynamo's yet, get
the same edit there. Both sets are cached: the caches are cleared when the fix applies and when it is removed.
Filters that match file names by a list of their own (``Tracer._find_user_frame``) still show the frame (see
``caveats``); the node stack traces of 2.0 - 2.7, which keep the whole stack unfiltered, are ``fx-stack-traces``'.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
import types

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result, fx_node_stack_traces, torch_module
from ..patching.patches import SourcePatch, torchfix_files
from ..patching.source import Edit, definitions, find_replaced, replace_node, segment

GUARDS = "torch._dynamo.guards"
SHAPES = "torch.fx.experimental.symbolic_shapes"
FUNCTION = "uninteresting_files"
FILES = "_torchfix_files"
SET_OF_MODULE_FILES = "{inspect.getfile(m) for m in mods}"


class _TorchfixFilesUninteresting(SourcePatch):
    def __init__(self, module: str) -> None:
        super().__init__(module, module.replace(".", "/") + ".py")

    def describe(self) -> str:
        return super().describe() + f"; adds {FILES} (torchfix's files) to {FUNCTION}()"

    def edits(self, source: str) -> list[Edit]:
        (returned,) = find_replaced(
            self.relpath,
            definitions(source).get(FUNCTION),
            f"`return {SET_OF_MODULE_FILES}` in {FUNCTION}()",
            lambda node: (
                isinstance(node, ast.Return)
                and node.value is not None
                and segment(source, node.value) == SET_OF_MODULE_FILES
            ),
        )
        return [replace_node(returned.value, f"{SET_OF_MODULE_FILES} | {FILES}")]

    def helpers(self) -> dict[str, object]:
        return {FILES: torchfix_files()}

    def _install_state(self, module: types.ModuleType, source: str) -> None:
        _clear_caches()

    def _remove_state(self, module: types.ModuleType) -> None:
        _clear_caches()


def _clear_caches() -> None:
    """Both sets are cached (``functools.cache``): computed before the edit (or after, once it is removed), they
    would keep the other's answer."""
    for name in (GUARDS, SHAPES):
        cached = getattr(sys.modules.get(name), FUNCTION, None)
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()


def _patches(torch_version: str) -> list[SourcePatch]:
    # From 2.6 the FX set unions Dynamo's; before, each is its own.
    own_fx_set = torch_version in releases("2.1", "2.5")
    return [_TorchfixFilesUninteresting(GUARDS)] + ([_TorchfixFilesUninteresting(SHAPES)] if own_fx_set else [])


def _probe() -> str | None:
    if FUNCTION not in vars(importlib.import_module(GUARDS)):
        return f"{GUARDS} has no {FUNCTION}() (before torch 2.1)"
    return None


def traced_stack_traces(timeout: float = 60.0) -> Result | None:
    """One thread: ``symbolic_trace`` with ``record_stack_traces`` of a module that calls a submodule (under
    ``trace-patch-isolation``, ``nn.Module.__call__`` is torchfix's dispatcher while a thread traces). Every
    node's stack trace must hold the user's frames and torch's filters' choice alone, no frame of torchfix's.
    None before 2.8, whose node stack traces are the whole stack, unfiltered."""
    proxy = torch_module("torch.fx.proxy")
    if FUNCTION not in inspect.getsource(proxy):
        return None
    importlib.import_module(GUARDS)  # the filters' set (Dynamo's), as any compile or export has it
    traces = fx_node_stack_traces()
    ours = [trace for trace in traces if "torchfix" in trace]
    detail = f"{len(ours)} of {len(traces)} node stack traces show a frame of torchfix's"
    return Result("stack traces of an FX trace (one thread)", bool(ours), detail + (f": {ours[0]!r}" if ours else ""))


FIX = Fix(
    name="stack-filters",
    order=5,
    hazard="torch's filters of its own frames out of user stack traces kept the frames torchfix adds",
    versions=releases("2.1"),
    probe=_probe,
    patches=_patches,
    trigger=GUARDS,
    scenarios=(
        Scenario(
            traced_stack_traces,
            releases("2.8"),
            needs="filtered node stack traces (torch 2.8+)",
            shows="node stack traces show a frame of torchfix's",
        ),
    ),
    shared_state=(
        "torch drops its own frames from the stack traces it records (FX nodes' `stack_trace`, the user frame of a "
        "guard or of a data-dependent error, structured logs) by file, through the cached set "
        "`torch._dynamo.guards.uninteresting_files()` (and `symbolic_shapes.uninteresting_files()` before 2.6); "
        "torchfix's few functions that stand between torch and the code it calls (`trace-patch-isolation`'s "
        "dispatcher in `nn.Module.__call__` while a thread traces) are not in it"
    ),
    symptom=(
        "in one thread, with torchfix: `symbolic_trace` with `record_stack_traces` gives every node under a "
        "submodule call a `torchfix/patching/slots.py ... in dispatch` line in its `stack_trace` (torch 2.13: "
        "2 of 7 nodes of a two-module trace)"
    ),
    releases_note='before 2.1 no such set: "not needed"',
    caveats=(
        "Filters with a list of file names of their own (`Tracer._find_user_frame`, unused by torch's own tracers in "
        "2.13) are left as they are; the node stack traces of torch 2.0 - 2.7, the whole stack unfiltered, are "
        "`fx-stack-traces`'."
    ),
    survey_rows=("torch/_dynamo/guards.py: uninteresting_files()",),
)
