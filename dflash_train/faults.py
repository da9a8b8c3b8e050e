"""Failures on purpose, for the tests of the error paths: a worker thread that raises, or hangs, at a step.

Nothing a user gives sets one (no flag, no setting): a test arms a fault in the trainer's process before the job
starts (``tests/dflash_with_fault.py`` runs the command line so), and ``Trainer`` wraps the step of the threads
a fault may hit with ``injected``. With none armed, ``injected`` returns the step unchanged.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

SPEC = re.compile(r"^(raise|hang)@(target|drafter):(\d+)$")
R = TypeVar("R")


@dataclass(frozen=True)
class Fault:
    action: str  # "raise" or "hang" (forever: only the watchdog or a second stop signal ends it)
    role: str  # "target" or "drafter"
    step: int  # the step (0-based) at whose start it strikes

    def inject(self, step: int) -> None:
        if step != self.step:
            return
        if self.action == "raise":
            raise RuntimeError(f"injected fault: {self.role} worker at step {step}")
        threading.Event().wait()


armed: Fault | None = None


def arm(spec: str) -> None:
    """Arm the fault ``spec`` says: 'raise@drafter:3', 'hang@target:0' (``raise|hang @ drafter|target:STEP``)."""
    global armed
    match = SPEC.match(spec)
    if match is None:
        raise ValueError(f"fault {spec!r}: use 'raise@drafter:STEP', 'hang@target:STEP', ...")
    armed = Fault(match[1], match[2], int(match[3]))


def injected(role: str, step_fn: Callable[[Any], R], *, here: bool) -> Callable[[Any], R]:
    """``step_fn`` (a thread's step: it takes the step's number or its batch), striking first where the armed
    fault says if it is for ``role`` and this thread is one it hits (``here``); else ``step_fn`` itself."""
    fault = armed
    if fault is None or fault.role != role or not here:
        return step_fn

    def step(arg: Any) -> R:
        fault.inject(getattr(arg, "step", arg))
        return step_fn(arg)

    return step
