"""torchfix: make torch's compile/trace state thread-local, so threads can share torch.compile.

``import torchfix`` (before or after torch) is the whole interface: it applies every fix this torch
needs, now or when torch is imported. ``status()`` says what was done and why; ``uninstall()`` undoes
it. ``TORCHFIX_DISABLE=1`` (or ``=fix-name,...``) turns fixes off; ``TORCHFIX_STRICT=1`` raises
instead of warning when a needed fix cannot be applied. ``python -m torchfix`` prints a report.
"""

from ._fix import FixStatus, State
from ._install import TorchfixError, TorchfixWarning, install, status, uninstall

__all__ = ["FixStatus", "State", "TorchfixError", "TorchfixWarning", "install", "status", "uninstall"]
__version__ = "0.1.0"

install()
