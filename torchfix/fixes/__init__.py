"""Every fix torchfix knows, in the order they are applied (and reverted in reverse)."""

from .._fix import Fix
from . import (
    backward_compile,
    compile_cache_recheck,
    compile_stance,
    compiler_flags,
    cudagraph_step_counters,
    cudagraph_thread_trees,
    cudagraph_tree_callable,
    export_builtins,
    export_deserializer,
    export_save,
    export_trace_state,
    fake_impl_ctx,
    fx_node_meta,
    fx_tracing_flag,
    guarded_backends,
    make_fx_tracer,
    pre_dispatch_modes,
    trace_patch_isolation,
)

ALL: list[Fix] = [
    fx_tracing_flag.FIX,
    compiler_flags.FIX,
    trace_patch_isolation.FIX,
    backward_compile.FIX,
    compile_cache_recheck.FIX,
    compile_stance.FIX,
    guarded_backends.FIX,
    fx_node_meta.FIX,
    export_deserializer.FIX,
    export_save.FIX,
    export_builtins.FIX,
    export_trace_state.FIX,
    pre_dispatch_modes.FIX,
    make_fx_tracer.FIX,
    fake_impl_ctx.FIX,
    cudagraph_thread_trees.FIX,
    cudagraph_tree_callable.FIX,
    cudagraph_step_counters.FIX,
]
