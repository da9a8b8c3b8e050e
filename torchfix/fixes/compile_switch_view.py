"""compile-switch-view: a compile runs with the SDPA backends its own thread chose, not another thread's.

Which SDPA kernel a graph calls is chosen while it is traced: ``scaled_dot_product_attention`` is a composite
operator whose C++ kernel reads the process-wide backend switches (``torch._C._get_*_sdp_enabled``) and dispatches
to the backend's operator, or to the math decomposition, and that is what AOTAutograd records; Dynamo's fake run
of it reads them too, and Dynamo folds ``torch.backends.cuda.*_sdp_enabled()`` to constants. No guard covers the
switches. So a graph another thread compiles while one thread is inside ``sdpa_kernel(SDPBackend.MATH)`` keeps
the math decomposition for good (torch 2.13, CPU: ``aten.bmm`` and ``_safe_softmax`` where the same compile
alone calls ``_scaled_dot_product_flash_attention_for_cpu``); by the code, one compiled while another thread is
inside ``sdpa_kernel(FLASH_ATTENTION)`` fails where flash does not fit its inputs.

Dynamo's compile of a frame (under ``compile_lock``, in ``CatchErrorsWrapper.__call__``) enters
:func:`torchfix.patching.switches.compile_view` too: the switches that another thread's ``sdpa_kernel`` holds
(``sdpa-kernel-switches`` counts them) are set, for the compile, to what the compiling thread sees of its own
(its own ``sdpa_kernel``'s, or the values before any), and are taken back after it like any override. Where no
other thread holds one, nothing is set: a compile in one thread runs exactly as without torchfix. Out of reach:
while the compile runs, the other thread's eager SDPA runs with the compiling thread's backends (one C++ setting
per switch; the window is the compile, the narrowest with a Python frame around every read); an ``sdpa_kernel``
another thread enters during the compile still reaches it; an export's ``set_flags(False)`` of mkldnn, nnpack and
cudnn is not set aside (the export is a trace that needs it meanwhile, as the compile needs its own); and exports,
``aot_compile`` and lazy backward compiles are not covered (the backward's kernel is fixed by its forward's).
"""

from __future__ import annotations

import ast
import importlib
import sys
import threading

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result, fresh, torch_module
from ..patching.patches import SourcePatch
from ..patching.source import Edit, find_replaced, insert_at, parse, segment
from ..patching.switches import compile_view

MODULE = "torch._dynamo.convert_frame"
VIEW = "_torchfix_compile_view"
COMPILE_BLOCK = ["compile_lock", "_disable_current_modes()"]


class _CompileView(SourcePatch):
    def __init__(self) -> None:
        super().__init__(MODULE, "torch/_dynamo/convert_frame.py")

    def describe(self) -> str:
        return super().describe() + f"; adds {VIEW} (_switches.compile_view) to the compile under compile_lock"

    def edits(self, source: str) -> list[Edit]:
        """``with compile_lock, _disable_current_modes():`` (in ``CatchErrorsWrapper.__call__``, before 2.4 in
        ``catch_errors_wrapper``'s ``catch_errors``) -> ``with ..., _torchfix_compile_view():``."""
        (block,) = find_replaced(
            self.relpath,
            parse(source),
            f"`with {', '.join(COMPILE_BLOCK)}:`",
            lambda node: (
                isinstance(node, ast.With)
                and [segment(source, item.context_expr) for item in node.items] == COMPILE_BLOCK
            ),
        )
        last = block.items[-1].context_expr
        return [insert_at(last.end_lineno, last.end_col_offset, f", {VIEW}()")]

    def helpers(self) -> dict[str, object]:
        return {VIEW: compile_view}


def _probe() -> str | None:
    if torch_module("torch.nn.attention") is None or not hasattr(sys.modules["torch.nn.attention"], "sdpa_kernel"):
        return "this torch has no sdpa_kernel (before 2.3)"
    return "compiles see their own switches already" if VIEW in vars(importlib.import_module(MODULE)) else None


def _attention(q):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, q, q)


def _compiled_ops() -> list[str]:
    """The operators of the forward graph AOTAutograd traces for a fresh compile of one SDPA."""
    import torch
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[list[str]] = []

    def record(gm, example_inputs):
        graphs.append([str(node.target) for node in gm.graph.nodes if node.op == "call_function"])
        return gm.forward

    torch.compile(fresh(_attention), backend=aot_autograd(fw_compiler=record))(torch.ones(1, 2, 8, 16))
    return graphs[0] if graphs else ["no graph"]


def compile_inside_sdpa_kernel_elsewhere(timeout: float = 60.0) -> Result | None:
    """While thread A is inside ``sdpa_kernel(SDPBackend.MATH)``, the main thread compiles a function that calls
    ``scaled_dot_product_attention``: its graph must call what the same compile calls with no thread inside
    (on CPU the flash kernel). None before torch 2.3."""
    attention = torch_module("torch.nn.attention")
    if attention is None or not hasattr(attention, "sdpa_kernel"):
        return None
    alone = _compiled_ops()
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:
        with attention.sdpa_kernel(attention.SDPBackend.MATH):
            inside.set()
            release.wait(timeout)

    thread = threading.Thread(target=hold, name="torchfix-selftest", daemon=True)
    thread.start()
    inside.wait(timeout)
    try:
        meanwhile = _compiled_ops()
    finally:
        release.set()
        thread.join(timeout)
    detail = f"the graph compiled alone calls {alone[0]}, the one compiled meanwhile {meanwhile[0]}"
    return Result("compile while another thread is inside sdpa_kernel(MATH)", meanwhile != alone, detail)


FIX = Fix(
    name="compile-switch-view",
    order=430,
    hazard="a graph compiled while another thread is inside sdpa_kernel keeps that thread's SDPA backend for good",
    versions=releases("2.3"),
    probe=_probe,
    patches=lambda _torch_version: [_CompileView()],
    trigger=MODULE,
    shared_state="the SDPA backend switches (one C++ setting each per process), which a compile reads while it "
    "traces scaled_dot_product_attention and no guard covers; another thread's sdpa_kernel sets them meanwhile",
    symptom="a function compiled while another thread is inside sdpa_kernel(SDPBackend.MATH) keeps the math "
    "decomposition for good (aten.bmm, _safe_softmax instead of _scaled_dot_product_flash_attention_for_cpu: 5 of 5 "
    "runs without the fix on torch 2.10, 2.13 and 2.15, CPU; 0 of 5 with it)",
    releases_note='2.3 - 2.15 (no sdpa_kernel before 2.3: "not needed")',
    scenarios=(
        Scenario(
            compile_inside_sdpa_kernel_elsewhere,
            releases("2.3"),
            needs="sdpa_kernel (2.3+)",
            shows="the one compiled meanwhile aten.mul",
        ),
    ),
    survey_rows=(
        "torch/_dynamo/convert_frame.py: (a compile's reads of the SDPA switches: _fused_sdp_choice, folded "
        "*_sdp_enabled())",
    ),
)
