"""torchfix: make torch's compile/trace state thread-local, so threads can share torch.compile.

``import torchfix`` (before or after torch) is the whole interface: it applies every fix this torch
needs, now or when torch is imported. ``status()`` says what was done and why; ``uninstall()`` undoes
it. ``TORCHFIX_DISABLE=1`` (or ``=fix-name,...``) turns fixes off; ``TORCHFIX_STRICT=1`` raises
instead of warning when a needed fix cannot be applied. ``python -m torchfix`` prints a report.

``propagate_config()`` (torch 2.12+, where Dynamo/Inductor config is per thread) makes the settings
made in the calling thread apply in every thread: call it once after configuring.

``watch()`` (a context manager) samples, from a thread of its own, the process state that torch's threads share,
and reports what one thread changed where the others could see it: ``python -m torchfix watch -- job.py``.
"""

import contextlib

from ._errors import TorchfixError, TorchfixWarning
from ._fix import FixStatus, State
from ._install import install, status, uninstall
from .patching.config import propagate_config

__all__ = [
    "FixStatus",
    "watch",
    "State",
    "TorchfixError",
    "TorchfixWarning",
    "install",
    "propagate_config",
    "status",
    "uninstall",
]
__version__ = "0.1.0"


def watch(interval: float = 0.02) -> contextlib.AbstractContextManager:
    """Watch torch's shared process state while the block runs: ``with torchfix.watch() as w: ...``, then
    ``w.report()``. See :mod:`torchfix.doctor.watch`."""
    from .doctor.watch import watch as _watch

    return _watch(interval)


install()
