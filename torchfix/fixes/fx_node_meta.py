"""fx-node-meta: the FX node metadata being recorded belongs to the thread that records it.

``torch.fx.traceback`` keeps the metadata that FX graph construction copies into every new node in module
globals: ``current_meta`` (the node being replayed or the stack trace being recorded, filled in by
``set_current_meta``, ``annotate``, ``set_stack_trace`` and by ``make_fx`` per dispatched op),
``should_preserve_node_meta`` (set by ``preserve_node_meta()``, which Dynamo and AOTAutograd enter for
every compile), and from torch 2.10 ``current_replay_node`` (and from 2.11 ``_should_preserve_node_meta``). All are
process globals up to 2.15 (upstream pytorch/pytorch#184917). So while one thread traces inside
``preserve_node_meta()`` + ``set_current_meta(node)``, another thread's ``get_current_meta()`` returns the
first thread's node meta and ``has_preserved_node_meta()`` is True: graphs traced or compiled at the same
time get each other's stack traces, ``custom`` annotations and sequence numbers.

The globals move to per-thread storage (``torch.fx.traceback._node_meta_tls``) with
:class:`ThreadLocalGlobals`: the flags keep their fast read, and each thread gets its own ``current_meta``
dict (``{}``, made on its first read; the installing thread keeps the dict it had). Other modules use
``fx_traceback.current_meta[...]`` by module attribute (AOTAutograd, ``make_fx``, checkpoint), which
reaches the module ``__getattr__`` and so the calling thread's dict. torch 2.13 - 2.15's
``_higher_order_ops/flex_attention.py`` imports ``current_meta`` by name, so its autograd forward read the dict
bound at import: the installing thread's, and upstream a stale one once any ``preserve_node_meta`` (every
compile) had rebound the global; its read goes through the module attribute too (:class:`ImportedNameUses`).
"""

from __future__ import annotations

import random
import sys
import threading
import warnings
from collections.abc import Callable

from .._fix import Fix, Scenario, SoakAction, SoakCheck, releases
from ..doctor.scenarios import Result, in_thread
from ..patching.patches import ImportedNameUses, ThreadLocalGlobals, moved_global_probe

MODULE = "torch.fx.traceback"
FLEX = "torch._higher_order_ops.flex_attention"
HOLDER = "_node_meta_tls"
GLOBALS = {
    "current_meta": "current_meta",
    "should_preserve_node_meta": "should_preserve_node_meta",
    "current_replay_node": "current_replay_node",  # 2.10+
    "_should_preserve_node_meta": "preserve_seq_nr",  # 2.11+
}


def node_meta_elsewhere(timeout: float = 60.0) -> Result:
    """While thread A records node metadata (``preserve_node_meta()`` and a stack trace, as Dynamo and
    AOTAutograd do for every graph they build), what the main thread's FX graphs would record: nothing."""
    from torch.fx import traceback as fx_traceback

    marker = "torchfix-selftest stack\n"
    inside, release = threading.Event(), threading.Event()

    def record() -> None:
        with fx_traceback.preserve_node_meta():
            fx_traceback.set_stack_trace([marker])
            inside.set()
            release.wait(timeout)

    thread = threading.Thread(target=record, name="torchfix-selftest")
    thread.start()
    inside.wait(timeout)
    preserved, meta = fx_traceback.has_preserved_node_meta(), fx_traceback.get_current_meta()
    release.set()
    thread.join(timeout)
    leaked = preserved or marker in str(meta.get("stack_trace"))
    detail = f"has_preserved_node_meta() {preserved}; stack_trace {meta.get('stack_trace')!r}"
    return Result("node meta (recorded in one thread, read by another thread's graphs)", leaked, detail)


def flex_sparsity_hint(timeout: float = 60.0) -> Result | None:
    """After a compile somewhere (``preserve_node_meta()``, which rebinds ``current_meta`` on exit), a thread runs
    flex attention's autograd forward inside ``annotate({"sparsity_hint": 0.5})``: the hint it records for its
    backward must be 0.5. On CPU (no flex backward there) the forward is called as the autograd key does. None
    before torch 2.13, where flex attention reads no sparsity hint."""
    import torch
    from torch.fx import traceback as fx_traceback

    try:
        from torch._higher_order_ops.flex_attention import FlexAttentionAutogradOp
        from torch.nn.attention.flex_attention import _apply_kernel_options, _create_empty_block_mask
    except ImportError:
        return None
    if "current_meta" not in vars(sys.modules[FLEX]):
        return None
    with fx_traceback.preserve_node_meta():
        pass

    def forward() -> float:
        q = torch.ones(1, 1, 1, 1, requires_grad=True)
        block_mask, options = _create_empty_block_mask(q, q).as_tuple(), _apply_kernel_options(q, q, q, False, None)
        with fx_traceback.annotate({"sparsity_hint": 0.5}), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flex attention without torch.compile: a warning, once
            out, _, _ = FlexAttentionAutogradOp.apply(
                q, q, q, lambda score, *_: score, None, block_mask, 1.0, options, ()
            )
        return out.grad_fn._sparsity_hint

    hint = in_thread(forward, timeout)
    if isinstance(hint, Exception):
        raise hint
    return Result("flex attention's sparsity hint (annotated in the calling thread)", hint != 0.5, f"recorded {hint}")


def soak_node_meta() -> Callable[[random.Random], None]:
    """The soak's ``node meta``: the stack trace a thread records must be its own."""
    from torch.fx import traceback as fx_traceback

    def record(rng: random.Random) -> None:
        marker = f"torchfix-stress {threading.get_ident()}"
        with fx_traceback.preserve_node_meta():
            fx_traceback.set_stack_trace([marker])
            seen = fx_traceback.get_current_meta().get("stack_trace")
        assert seen is not None and marker in seen, f"node meta of another thread: {seen!r}"

    return record


def soak_leak_probe() -> Callable[[bool], bool]:
    """Whether the calling thread preserves node meta, or has any."""
    from torch.fx import traceback as fx_traceback

    return lambda at_end: fx_traceback.has_preserved_node_meta() or bool(fx_traceback.get_current_meta())


FIX = Fix(
    name="fx-node-meta",
    order=80,
    hazard="while one thread traces with node metadata (preserve_node_meta, set_current_meta), other threads' "
    "FX graphs get its stack traces and metadata",
    versions=releases("2.0"),
    probe=moved_global_probe(MODULE, HOLDER, "current_meta", f"{MODULE} has no global current_meta (changed upstream)"),
    patches=lambda _torch_version: [
        ThreadLocalGlobals(
            MODULE,
            "torch/fx/traceback.py",
            HOLDER,
            GLOBALS,
            optional=frozenset({"current_replay_node", "_should_preserve_node_meta"}),
            seen_in_backward=True,
        ),
        # torch 2.13+: flex attention's autograd forward reads the sparsity hint from a by-name import.
        ImportedNameUses(
            FLEX, "torch/_higher_order_ops/flex_attention.py", MODULE, HOLDER, {"current_meta": GLOBALS["current_meta"]}
        ),
    ],
    trigger=MODULE,
    # Stage 1: without the fix, torch 2.2 keeps the recorded meta in the process after the scenario.
    scenarios=(
        Scenario(node_meta_elsewhere, releases("2.0"), stage=1),
        # Stage 2: flex attention's eager path runs vmap, whose first call lazy-init-locks' scenario (stage 1) needs.
        Scenario(
            flex_sparsity_hint,
            releases("2.13"),
            needs="flex attention reading a sparsity hint (2.13+)",
            shows="recorded 0.0",
            stage=2,
        ),
    ),
    shared_state=(
        "`torch.fx.traceback`'s `current_meta`, `should_preserve_node_meta` (and from 2.10 – 2.11 "
        "`current_replay_node`, `_should_preserve_node_meta`), the metadata FX copies into every new node, are "
        "process globals (upstream #184917)"
    ),
    symptom=(
        "while one thread traces or compiles with node metadata, other threads' graphs get its stack traces, "
        "annotations and sequence numbers (`has_preserved_node_meta()` is `True` everywhere); from 2.13, flex "
        "attention's autograd forward, which imports `current_meta` by name, records the sparsity hint of the "
        'dict bound at import, not the calling thread\'s `annotate({"sparsity_hint": ...})` (stale even in one '
        "thread after any compile: 0.0 instead of 0.5, torch 2.13, 2.15); it now reads it through the module"
    ),
    soak=SoakCheck(
        errors=("node meta of another thread",),
        actions=(SoakAction("node meta", 2, soak_node_meta),),
        leak_probe=soak_leak_probe,
    ),
    survey_rows=(
        "torch/_higher_order_ops/flex_attention.py: current_meta (imported by name)",
        "torch/fx/traceback.py: current_meta",
        "torch/fx/traceback.py: should_preserve_node_meta",
        "torch/fx/traceback.py: _should_preserve_node_meta",
        "torch/fx/traceback.py: current_replay_node",
        "torch/_functorch/_aot_autograd/graph_capture_wrappers.py, fx/experimental/proxy_tensor.py: "
        "fx_traceback.current_meta (item writes)",
    ),
)
