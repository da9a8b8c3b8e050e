"""draft-export-trace: overlapping draft exports leave the detailed-trace switch as they found it.

``torch.export.draft_export`` captures torch's structured trace while it exports (``CaptureStructuredTrace``), and
for that turns on ``torch._logging._internal.GET_DTRACE_STRUCTURED``, the process-wide switch of the detailed
trace (``dtrace_structured``: symbolic-shape provenance, fake-kernel checks), saving the value it found and putting
it back at its end. Two draft exports in two threads that overlap, the first to start ending first, leave it
switched on for good (the second saved the first's True): every later symbolic op pays the provenance bookkeeping
and a ``TORCH_TRACE`` log gets the detailed entries. Every release that has draft export, 2.6 - 2.15.

The switch stays process-wide (``_init_logs`` sets it for the whole process from the user's trace settings, and a
capture's handler on the process-wide ``torch.__trace`` logger takes every thread's records, so reports of two
captures at once can mix: logging's state, out of reach). What changes is the save and restore: the captures under
way are counted, the first saves the switch and the last puts it back.
"""

from __future__ import annotations

import ast
import importlib
import threading

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result, torch_module
from ..patching.patches import SourcePatch
from ..patching.source import Edit, definitions, find_replaced, replace_node, segment

MODULE = "torch.export._draft_export"
SWITCH = "torch._logging._internal.GET_DTRACE_STRUCTURED"
CAPTURES = "_torchfix_dtrace_captures"


class DtraceCaptures:
    """The draft-export captures under way in the process: the first turns the switch on, the last restores it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._found = False  # the switch before the first capture

    def enter(self) -> None:
        import torch._logging._internal as logging_internal

        with self._lock:
            if self._count == 0:
                self._found = logging_internal.GET_DTRACE_STRUCTURED
            self._count += 1
            logging_internal.GET_DTRACE_STRUCTURED = True

    def exit(self) -> None:
        import torch._logging._internal as logging_internal

        with self._lock:
            self._count = max(0, self._count - 1)  # an exit without its enter (torch's own misuse) goes no lower
            if self._count == 0:
                logging_internal.GET_DTRACE_STRUCTURED = self._found


class _CountedCaptures(SourcePatch):
    def __init__(self) -> None:
        super().__init__(MODULE, "torch/export/_draft_export.py")

    def describe(self) -> str:
        return super().describe() + f"; adds {CAPTURES} (the captures under way, counted)"

    def edits(self, source: str) -> list[Edit]:
        methods = definitions(source)
        edits = []
        for method, replacement in (("__enter__", f"{CAPTURES}.enter()"), ("__exit__", f"{CAPTURES}.exit()")):
            (write,) = find_replaced(
                self.relpath,
                methods.get(f"CaptureStructuredTrace.{method}"),
                f"write of {SWITCH} in CaptureStructuredTrace.{method}",
                lambda node: isinstance(node, ast.Assign) and [segment(source, t) for t in node.targets] == [SWITCH],
            )
            edits.append(replace_node(write, replacement))
        return edits

    def helpers(self) -> dict[str, object]:
        return {CAPTURES: DtraceCaptures()}


def _probe() -> str | None:
    capture = getattr(importlib.import_module(MODULE), "CaptureStructuredTrace", None)
    if capture is None:
        return f"{MODULE} has no CaptureStructuredTrace"
    return None


def overlapping_draft_captures(timeout: float = 60.0) -> Result | None:
    """Threads A and B each enter a draft export's trace capture (A first) and leave it in the same order (A
    first): afterwards the detailed-trace switch must be what it was before. None where torch has no draft export
    (before 2.6)."""
    logging_internal, draft = torch_module("torch._logging._internal"), torch_module(MODULE)
    capture = getattr(draft, "CaptureStructuredTrace", None)
    if capture is None:
        return None
    before = logging_internal.GET_DTRACE_STRUCTURED
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    errors: list[str] = []

    def a() -> None:
        try:
            with capture():
                a_in.set()
                b_in.wait(timeout)
        except Exception as exc:
            errors.append(f"A raised {type(exc).__name__}: {exc}")
        finally:
            a_in.set()
            a_out.set()

    def b() -> None:
        try:
            a_in.wait(timeout)
            with capture():
                b_in.set()
                a_out.wait(timeout)
        except Exception as exc:
            errors.append(f"B raised {type(exc).__name__}: {exc}")
        finally:
            b_in.set()

    threads = [threading.Thread(target=t, name=f"torchfix-selftest-{t.__name__}", daemon=True) for t in (a, b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    after = logging_internal.GET_DTRACE_STRUCTURED
    logging_internal.GET_DTRACE_STRUCTURED = before  # what the scenario leaves: as it found it
    detail = f"GET_DTRACE_STRUCTURED {before} before, {after} after" + "".join(f"; {e}" for e in errors)
    return Result("draft export trace (two threads' captures overlapping)", after != before or bool(errors), detail)


FIX = Fix(
    name="draft-export-trace",
    order=398,
    hazard="two threads' draft exports that overlap leave torch's detailed structured trace switched on for good",
    versions=releases("2.6"),
    probe=_probe,
    patches=lambda _torch_version: [_CountedCaptures()],
    trigger=MODULE,
    scenarios=(
        Scenario(
            overlapping_draft_captures,
            releases("2.6"),
            needs="torch.export.draft_export (2.6+)",
            shows="False before, True after",
        ),
    ),
    shared_state=(
        "`torch.export.draft_export` turns on torch's detailed structured trace "
        "(`torch._logging._internal.GET_DTRACE_STRUCTURED`, a process-wide switch) while it captures, saving and "
        "restoring what it found"
    ),
    symptom=(
        "two draft exports in two threads that overlap, the first ending first, left the switch on for good (the "
        "later one had saved the earlier's True): every later symbolic op pays the provenance bookkeeping; now "
        "the captures under way are counted, the last restores the switch (the switch and the capture's log "
        "handler stay process-wide, by torch's design)"
    ),
    releases_note='no draft export before 2.6: "not needed"',
    survey_rows=("torch/export/_draft_export.py: torch._logging._internal.GET_DTRACE_STRUCTURED",),
)
