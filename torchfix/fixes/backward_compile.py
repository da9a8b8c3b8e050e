"""backward-compile-deadlock: compile backward graphs with their forward, not lazily (hazard H5).

AOTAutograd compiles a backward graph lazily, at the first backward. On CUDA that backward runs on
autograd's device thread, and from torch 2.6 Inductor's backward compiler takes Dynamo's
``compile_lock``. If another thread holds ``compile_lock`` in a forward compile meanwhile, it traces
the joint graph through ``torch.autograd.grad`` on fake tensors of the same device, which needs that
same device thread: each waits for the other and the job hangs with no error.

Eager backward lowering compiles the backward inside the forward compile, under the lock the forward
already holds, so nothing compiles on the device thread. torch has the switch from 2.9: a keyword of
``prepare_aot_module_simplified`` (2.9), then ``torch._functorch.config.force_non_lazy_backward_lowering``
(2.10+). From 2.12 config assignments are per-thread, so setting it in the main thread would not reach
the threads that compile; this fix changes the entry's default, which every thread reads.

torch 2.6 - 2.8 have no switch, but they have the eager path the switch turns on: AOTAutograd's
``aot_dispatch_autograd`` compiles the backward with the forward for graphs that save symbolic ints
(``if num_symints_saved_for_bw > 0:``). There the fix widens that condition to every graph, and on 2.6 -
2.7, whose eager path compiles ``bw_module`` itself, hands the compiler a copy as 2.8 does (compiled
autograd retraces ``bw_module`` later, and Inductor's passes change the graph they get). A backward whose
eager compile fails is still compiled lazily, with torch's warning, as upstream does for dynamic shapes.

Cost: a graph compiled for training has its backward compiled up front, also if it is never used.

Applied when AOTAutograd is imported (by the first compile): every release's switch or eager path is read there
first, and importing ``torch._functorch.config`` at ``import torchfix`` cost 8 ms on the 2-core CPU machine.
"""

from __future__ import annotations

import ast
import importlib

from .._fix import Fix, minor_release, releases
from ..patching.defaults import ConfigDefault, KeywordDefault
from ..patching.patches import SourcePatch
from ..patching.source import Edit, definitions, find_replaced, replace_node, segment

SWITCH = "force_non_lazy_backward_lowering"
CONFIG = "torch._functorch.config"
AOT = "torch._functorch.aot_autograd"
KEYWORD_FUNCTION = "prepare_aot_module_simplified"  # torch 2.9
EAGER_PATH = "torch._functorch._aot_autograd.jit_compile_runtime_wrappers"  # torch 2.6 - 2.8
ALWAYS = "_compile_backward_with_forward"
COPY = "_backward_graph_copy"


def backward_graph_copy(bw_module: object) -> object:
    """What torch 2.8's eager path compiles: a copy of the backward graph (made outside fake mode: it may
    hold real constants)."""
    import copy

    import torch

    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        return copy.deepcopy(bw_module)


class _EagerBackwardPath(SourcePatch):
    """torch 2.6 - 2.8: AOTAutograd's eager backward compile, taken for every graph."""

    def __init__(self) -> None:
        super().__init__(EAGER_PATH, "torch/_functorch/_aot_autograd/jit_compile_runtime_wrappers.py")

    def describe(self) -> str:
        return super().describe() + "; the backward of every graph is compiled with its forward"

    def edits(self, source: str) -> list[Edit]:
        function = definitions(source).get("aot_dispatch_autograd")
        branches = [
            node
            for node in (ast.walk(function) if function is not None else ())
            if isinstance(node, ast.If) and segment(source, node.test) == "num_symints_saved_for_bw > 0"
        ]
        (compile_call,) = find_replaced(
            self.relpath,
            branches,
            "eager backward compile in aot_dispatch_autograd",
            lambda node: isinstance(node, ast.Call) and segment(source, node.func) == "aot_config.bw_compiler",
        )
        branch = next(b for b in branches if any(node is compile_call for node in ast.walk(b)))
        edits = [replace_node(branch.test, f"num_symints_saved_for_bw > 0 or {ALWAYS}")]
        if segment(source, compile_call.args[0]) == "bw_module":  # 2.6 - 2.7 compile the graph itself
            edits.append(replace_node(compile_call.args[0], f"{COPY}(bw_module)"))
        return edits

    def helpers(self) -> dict[str, object]:
        return {ALWAYS: True, COPY: backward_graph_copy}


def _config_entry() -> object | None:
    return getattr(importlib.import_module(CONFIG), "_config", {}).get(SWITCH)


def _probe() -> str | None:
    import torch

    release = minor_release(str(torch.__version__))
    if release is not None and release < (2, 6):  # a version we cannot read is the versions check's to refuse
        return "before torch 2.6 the backward compiler does not take compile_lock"
    entry = _config_entry()
    if entry is not None:
        return "eager backward lowering is already the default" if entry.default is True else None
    function = getattr(importlib.import_module(AOT), KEYWORD_FUNCTION, None)
    if function is not None and (function.__kwdefaults__ or {}).get(SWITCH) is True:
        return "eager backward lowering is already the default"
    return None


def _patches(torch_version: str) -> list:
    release = minor_release(torch_version)
    if release >= (2, 10):
        return [ConfigDefault(CONFIG, SWITCH, True)]
    if release >= (2, 9):
        return [KeywordDefault(AOT, KEYWORD_FUNCTION, SWITCH, True)]
    return [_EagerBackwardPath()]


FIX = Fix(
    name="backward-compile-deadlock",
    order=40,
    hazard="threads sharing a device deadlock: a lazy backward compile on autograd's device thread waits "
    "for compile_lock held by a forward compile that waits for that device thread",
    versions=releases("2.6"),
    probe=_probe,
    patches=_patches,
    trigger=AOT,
    shared_state=(
        "H5: a lazy backward compile on autograd's device thread waits for `compile_lock`, held by another "
        "thread's forward compile that waits for that device thread"
    ),
    symptom="threads sharing a GPU hang with no error at their first training step",
    releases_note=(
        "torch's switch from 2.9; on 2.6 – 2.8 its eager path for dynamic shapes, taken for every graph; before "
        '2.6 the backward compiler takes no lock: "not needed"'
    ),
    caveats=(
        "It compiles a training graph's backward together with its forward (torch's own "
        "`force_non_lazy_backward_lowering`, made the default for every thread): backward graphs are compiled up "
        "front, also those never used."
    ),
    survey_rows=("torch/_functorch/_aot_autograd/runtime_wrappers.py: CompiledFunction.compiled_bw",),
)
