"""Every fix torchfix knows, in the order they are applied (and reverted in reverse)."""

from .._fix import Fix
from . import fx_tracing_flag

ALL: list[Fix] = [fx_tracing_flag.FIX]
