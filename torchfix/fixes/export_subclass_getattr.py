"""export-subclass-getattr: non-strict export's ``__getattribute__`` patch of a tensor subclass acts only in
the exporting thread.

A non-strict ``torch.export.export`` whose inputs (parameters, buffers, arguments) hold tensor subclasses (torchao's
quantized weights, ``TwoTensor``) replaces each subclass's ``__getattribute__`` for its trace
(``override_getattribute_for_subclasses`` in ``torch/export/_trace.py``, torch 2.7+), so that reading an inner
tensor records ``export.access_subclass_inner_tensor`` in the graph. It writes the class attribute, process-wide, and
puts back what it found when the trace ends. While it traces, every attribute read of that subclass in every thread
runs the exporter's wrapper in Python. Two exports of one subclass type that overlap in time restore out of order:
the second finds the first one's wrapper, wraps it and finally puts it back, so that wrapper stays on the class for
good (reproduced on torch 2.10, 2.13 and 2.15): every later attribute read of the subclass, in any thread, goes
through it.

The three lines go through ``torch.export._trace._thread_patches``, a ``ThreadPatches`` (``patching/slots.py``,
the per-thread dispatcher of trace-patch-isolation): the read of the method to wrap is the calling thread's view (the
class's own method, never another thread's wrapper), the write patches the calling thread only, and the restore
undoes it. torch writes a ``functools.partialmethod``; the dispatcher calls its function as the class attribute
gives it (``partialmethod.__get__(None, cls)``).
"""

from __future__ import annotations

import importlib.util
import threading

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result
from ..patching.patches import source_without_import
from ..patching.slots import HELPER, SlotPatches

MODULE = "torch.export._trace"
FUNCTION = "override_getattribute_for_subclasses"  # nested in the non-strict trace (_export_to_aten_ir_make_fx)
ATTR = "__getattribute__"


def _probe() -> str | None:
    if importlib.util.find_spec("torch.export") is None:
        return "torch has no torch.export (before 2.1)"
    source = source_without_import(MODULE) or ""
    if f"def {FUNCTION}(" not in source:
        return f"{MODULE} has no {FUNCTION} (before 2.7): no subclass patches"
    module = importlib.import_module(MODULE)  # the trigger: imported already
    if HELPER in vars(module):
        return "the subclass patches are per-thread already"
    return None


class _HeldSubclassExport:
    """A thread inside a non-strict ``torch.export.export`` of a module that reads both inner tensors of its
    ``TwoTensor`` input; its forward waits there until :meth:`end`, which says what the export made."""

    def __init__(self, two_tensor: type, timeout: float) -> None:
        import torch

        self.timeout, self.entered, self.release, self.answers = timeout, threading.Event(), threading.Event(), []
        entered, release = self.entered, self.release

        class Reads(torch.nn.Module):
            def forward(self, x):
                entered.set()
                release.wait(timeout)
                return x.a * 2 + x.b

        def export() -> None:
            try:
                program = torch.export.export(Reads(), (two_tensor(torch.ones(2), torch.ones(2)),), strict=False)
                reads = sum("access_subclass_inner_tensor" in str(node.target) for node in program.graph.nodes)
                self.answers.append(f"exported ({reads} inner-tensor reads in its graph)")
            except Exception as exc:
                self.answers.append(f"raised {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}")

        self.thread = threading.Thread(target=export, name="torchfix-selftest", daemon=True)
        self.thread.start()
        self.entered.wait(timeout)

    def end(self) -> str:
        self.release.set()
        self.thread.join(self.timeout)
        return (self.answers or ["no answer"])[0]


def overlapping_subclass_exports(timeout: float = 60.0) -> Result | None:
    """Threads A and B export (non-strict) a module with a ``TwoTensor`` input; A starts first, B starts while A
    traces, and A finishes first. Both must export, each recording its two inner-tensor reads, and afterwards
    ``TwoTensor.__getattribute__`` must be the class's own again. None where torch has no non-strict export of a
    subclass input (before 2.7) or no ``TwoTensor``."""
    if f"def {FUNCTION}(" not in (source_without_import(MODULE) or ""):
        return None
    try:
        from torch.testing._internal.two_tensor import TwoTensor
    except ImportError:
        return None
    own, had = TwoTensor.__getattribute__, vars(TwoTensor).get(ATTR)
    first = _HeldSubclassExport(TwoTensor, timeout)
    second = _HeldSubclassExport(TwoTensor, timeout)
    outcomes = [first.end(), second.end()]
    left = TwoTensor.__getattribute__ is not own
    if left:  # put the class back for the scenarios after this one
        if had is None:
            delattr(TwoTensor, ATTR)
        else:
            TwoTensor.__getattribute__ = had
    detail = f"the first export {outcomes[0]}; the second {outcomes[1]}"
    detail += "; left patched: TwoTensor.__getattribute__ (an exporter's wrapper, for good)" if left else ""
    hazard = left or not all(outcome == "exported (2 inner-tensor reads in its graph)" for outcome in outcomes)
    return Result("subclass exports (two threads' non-strict exports of a TwoTensor input overlapping)", hazard, detail)


FIX = Fix(
    name="export-subclass-getattr",
    order=395,
    hazard="non-strict torch.export.export patches a tensor subclass's __getattribute__ for the process while it "
    "traces; two exports of one subclass that overlap leave an exporter's wrapper on the class for good",
    versions=releases("2.7"),
    probe=_probe,
    patches=lambda _torch_version: [SlotPatches(MODULE, FUNCTION, owner=None, attr=ATTR, reads=1, bind=True)],
    trigger=MODULE,
    scenarios=(
        Scenario(
            overlapping_subclass_exports,
            releases("2.7"),
            needs="non-strict export of a tensor subclass input (2.7+)",
            shows="left patched: TwoTensor.__getattribute__",
            stage=3,
        ),
    ),
    shared_state=(
        "non-strict `torch.export.export` of a module whose inputs hold tensor subclasses (torchao's quantized "
        "weights, `TwoTensor`) replaces each subclass's `__getattribute__` for the process while it traces "
        "(`override_getattribute_for_subclasses`) and puts back what it found"
    ),
    symptom=(
        "every thread's attribute reads of that subclass run the exporter's wrapper in Python while it traces; "
        "two exports of one subclass type that overlap leave an exporter's wrapper on the class for good (torch "
        "2.10, 2.13, 2.15: every later attribute read of the subclass goes through it). Now per thread, through "
        "the same dispatcher"
    ),
    releases_note='before 2.7: "not needed"',
    caveats=(
        "While any thread holds such a patch, the class slot holds the dispatcher, a Python function: every "
        "attribute read of that subclass in every thread goes through it, as it went through torch's wrapper "
        "before; the class's own method comes back once no thread holds the patch, where torch left an explicit "
        "copy in the class."
    ),
    survey_rows=("torch/export/_trace.py: tensor-subclass __getattribute__",),
)
