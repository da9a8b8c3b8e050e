"""fx-stack-traces: on torch 2.0 - 2.7, FX node stack traces leave out the frames torchfix adds, as they were before.

A ``torch.fx.Tracer`` with ``record_stack_traces`` gives each node the stack it was recorded at
(``TracerBase.create_proxy``). Torch 2.0 - 2.7 keep that whole stack, torch's own frames included (2.8+ filter it
through ``torch._dynamo.guards.uninteresting_files()``, which ``stack-filters`` tells about torchfix's files). While
a thread traces, ``trace-patch-isolation`` makes ``nn.Module.__call__`` torchfix's per-thread dispatcher, so every
node recorded under a submodule call got one frame more, ``torchfix/patching/slots.py ... in dispatch``, in one
thread: the equivalence run's ``symbolic_trace`` case differed on torch 2.2, with torchfix and without.

The edit drops the frames of torchfix's own files from the stack ``create_proxy`` formats, and nothing else: the
stack is taken where and as torch takes it (``traceback.StackSummary.extract`` of ``walk_stack`` on 2.0,
``traceback.extract_stack(user_frame)`` on 2.1 - 2.3, ``CapturedTraceback.extract()`` on 2.4 - 2.7), and its other
frames keep their order and text.
"""

from __future__ import annotations

import ast
import os
import traceback

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result, fx_node_stack_traces, torch_module
from ..patching.patches import SourcePatch, torchfix_files
from ..patching.source import Edit, definitions, find_replaced, replace_node, segment

MODULE = "torch.fx.proxy"
FUNCTION = "TracerBase.create_proxy"
HELPER = "_torchfix_frames_dropped"
# The stack create_proxy formats, as each release takes it (2.0, 2.1 - 2.3, 2.4 - 2.7), and the edit's text for it.
EDITS = {
    "traceback.StackSummary.extract(walk_stack_gen)": f"{HELPER}(traceback.StackSummary.extract(walk_stack_gen))",
    "traceback.extract_stack(user_frame)": f"{HELPER}(traceback.extract_stack(user_frame))",
    "CapturedTraceback.extract().format()": f"{HELPER}(CapturedTraceback.extract().summary()).format()",
}


def frames_dropped(summary: traceback.StackSummary, files: frozenset[str]) -> traceback.StackSummary:
    """``summary`` without the frames of ``files``."""
    return traceback.StackSummary.from_list([frame for frame in summary if frame.filename not in files])


def _filters_its_stacks() -> bool:
    """Whether torch's tracer drops its own frames from node stack traces by ``uninteresting_files()``: in
    ``create_proxy`` on 2.8 and 2.9, in a method of its own from 2.10."""
    methods = vars(torch_module(MODULE).TracerBase).values()
    return any("uninteresting_files" in method.__code__.co_names for method in methods if hasattr(method, "__code__"))


class _OwnFramesDropped(SourcePatch):
    def __init__(self) -> None:
        super().__init__(MODULE, "torch/fx/proxy.py")

    def describe(self) -> str:
        return super().describe() + f"; adds {HELPER}, which drops torchfix's frames from a node's stack trace"

    def edits(self, source: str) -> list[Edit]:
        (taken,) = find_replaced(
            self.relpath,
            definitions(source).get(FUNCTION),
            f"stack that {FUNCTION}() records ({' or '.join(EDITS)})",
            lambda node: isinstance(node, ast.Call) and segment(source, node) in EDITS,
        )
        return [replace_node(taken, EDITS[segment(source, taken)])]

    def helpers(self) -> dict[str, object]:
        files = torchfix_files()
        return {HELPER: lambda summary: frames_dropped(summary, files)}


def _probe() -> str | None:
    if _filters_its_stacks():
        return "torch filters its node stack traces itself (2.8+): stack-filters makes torchfix's frames torch's"
    return None


def traced_stack_traces_unfiltered(timeout: float = 60.0) -> Result | None:
    """One thread: a trace with ``record_stack_traces`` of a module that calls a submodule, on a torch that keeps
    the whole stack (2.0 - 2.7): no node's stack trace may hold a frame of torchfix's. The scenario's own frames
    are torchfix's too (as they are for ``stack-filters``' scenario), so with torchfix uninstalled they show it;
    the detail counts the traces with the frame a user's trace would show, the per-thread dispatcher's. None on
    2.8+."""
    if _filters_its_stacks():
        return None
    files = torchfix_files()
    dispatcher = [file for file in files if f"{os.sep}patching{os.sep}" in file]
    traces = fx_node_stack_traces()
    ours = [trace for trace in traces if any(f'"{file}"' in trace for file in files)]
    dispatched = [trace for trace in traces if any(f'"{file}"' in trace for file in dispatcher)]
    detail = f"{len(ours)} of {len(traces)} node stack traces show a frame of torchfix's"
    detail += f" ({len(dispatched)} its dispatcher's)"
    return Result("unfiltered stack traces of an FX trace (one thread)", bool(ours), detail)


FIX = Fix(
    name="fx-stack-traces",
    order=6,
    hazard="FX node stack traces, which keep the whole stack, showed the frame of torchfix's dispatcher",
    versions=releases("2.0", "2.7"),
    probe=_probe,
    patches=lambda _torch_version: [_OwnFramesDropped()],
    scenarios=(
        Scenario(
            traced_stack_traces_unfiltered,
            releases("2.0", "2.7"),
            needs="unfiltered node stack traces (torch 2.0 - 2.7)",
            shows="node stack traces show a frame of torchfix's",
        ),
    ),
    shared_state=(
        "torch 2.0 - 2.7 record an FX node's `stack_trace` as the whole stack (`TracerBase.create_proxy`), torchfix's "
        "frames among them: `trace-patch-isolation`'s dispatcher in `nn.Module.__call__` while a thread traces"
    ),
    symptom=(
        "in one thread, with torchfix: a `torch.fx.Tracer` with `record_stack_traces` gives every node recorded "
        "under a submodule call a `torchfix/patching/slots.py ... in dispatch` line (torch 2.2, the equivalence "
        "run's `symbolic_trace` case)"
    ),
    releases_note='from 2.8 torch filters the stack itself (`stack-filters`): "not needed"',
)
