"""Every fix torchfix knows, in the order they are applied (and reverted in reverse)."""

from .._fix import Fix
from . import backward_compile, compile_cache_recheck, compiler_flags, fx_tracing_flag, trace_patch_isolation

ALL: list[Fix] = [
    fx_tracing_flag.FIX,
    compiler_flags.FIX,
    trace_patch_isolation.FIX,
    backward_compile.FIX,
    compile_cache_recheck.FIX,
]
