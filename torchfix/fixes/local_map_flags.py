"""local-map-flags: ``defer_inlining()`` and local_map's Dynamo wrapping switch act in their own thread.

Two switches of the local_map higher-order op (torch 2.10+, used by AutoParallel) are process-wide:

* ``torch._higher_order_ops.local_map._DEFER_INLINING``, a module global that ``defer_inlining()`` saves, sets and
  restores. local_map's Autograd kernel reads it (deferred: trace the op's joint graph with local shapes and wrap it
  in ``LocalMapAutogradOp``; else: inline the op's graph), and so does its Fake kernel (deferred: run the graph on
  local shapes). While one thread is inside ``defer_inlining()``, another thread's trace through local_map takes
  the deferred path: it fails (``AssertionError: actual_bw_inputs must be > 0``) or traces with local shapes.
* ``LocalMapWrappedHigherOrderVariable._enabled`` in ``torch/_dynamo/variables/higher_order_ops.py``, a class
  attribute that its ``enable()`` context manager saves, sets and restores: while one thread is inside, every
  thread's Dynamo trace wraps ``local_map`` functions in the higher-order op.

The global moves to per-thread storage (``local_map._defer_inlining_tls``) with :class:`ThreadLocalGlobals`. The
class attribute stays torch's, so that a direct read sees in one thread what it sees without torchfix, but
``enable()`` sets it as a counted override (``torchfix.patching.switches``: overlapping entries in several threads
leave it as found) and ``should_wrap_in_hop()`` reads the calling thread's own setting: its entry's, else the value
before the first entry (a direct write made outside any entry is seen).

Where the value is read matters: ``LocalMapAutogradOp.backward`` calls local_map again (its Fake kernel, when a
joint graph is traced), and backward can run on autograd's device thread (CUDA), which before torch 2.13 has a
thread-local value of its own, not the forward thread's (``ThreadSpaces``). Since the Autograd kernel makes a
``LocalMapAutogradOp`` only when inlining is deferred, its backward now runs inside ``defer_inlining()`` itself,
on whichever thread: as torch's global had it while the tracing thread was inside ``defer_inlining()``.
"""

from __future__ import annotations

import ast
import importlib

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result, held_elsewhere, torch_module
from ..patching.patches import (
    PerThreadName,
    SourcePatch,
    ThreadLocalGlobals,
    moved_global_probe,
    refuse_accesses_left,
)
from ..patching.source import Edit, ShapeError, definition, find_replaced, parse, replace_node
from ..patching.switches import Override, Switch, own_value

LOCAL_MAP = "torch._higher_order_ops.local_map"
FLAG, HOLDER = "_DEFER_INLINING", "_defer_inlining_tls"
BACKWARD = "LocalMapAutogradOp.backward"
DEFERRED_CALL = "_local_map_hop_deferred"  # helper in local_map: local_map_hop inside defer_inlining()
HOPS = "torch._dynamo.variables.higher_order_ops"
WRAPPED, SWITCH = "LocalMapWrappedHigherOrderVariable", "_local_map_wrapping"


class _DeferPerThread(ThreadLocalGlobals):
    """``_DEFER_INLINING`` per thread, and ``LocalMapAutogradOp.backward``'s call of local_map deferred."""

    def __init__(self) -> None:
        super().__init__(
            LOCAL_MAP, LOCAL_MAP.replace(".", "/") + ".py", HOLDER, {FLAG: "deferred"}, seen_in_backward=True
        )

    def describe(self) -> str:
        return super().describe() + f"; {BACKWARD} calls local_map_hop inside defer_inlining() (any thread)"

    def edits(self, source: str) -> list[Edit]:
        (call,) = find_replaced(
            self.relpath,
            definition(source, self.relpath, BACKWARD),
            f"call of local_map_hop in {BACKWARD}",
            lambda node: (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "local_map_hop"
            ),
        )
        return [*super().edits(source), replace_node(call.func, DEFERRED_CALL)]

    def helpers(self) -> dict[str, object]:
        module = importlib.import_module(self.module_name)

        def deferred(*args: object, **kwargs: object) -> object:
            with module.defer_inlining():
                return module.local_map_hop(*args, **kwargs)

        return {DEFERRED_CALL: deferred}


class _Wrapping:
    """``LocalMapWrappedHigherOrderVariable._enabled`` as a counted override (:mod:`torchfix.patching.switches`):
    ``enable()`` sets the class attribute as torch does, so that a direct read in one thread sees what it sees without
    torchfix, and exits in any order leave it as found; ``should_wrap_in_hop`` reads the calling thread's own
    setting."""

    def __init__(self, cls: type) -> None:
        self._switch = Switch(
            f"{WRAPPED}._enabled", lambda: cls._enabled, lambda value: setattr(cls, "_enabled", value)
        )

    def __call__(self) -> Override:
        return Override(lambda: {self._switch: True})

    def own(self) -> object:
        return own_value(self._switch)


class _WrappingPerThread(SourcePatch):
    """``LocalMapWrappedHigherOrderVariable.enable()`` through a counted override of ``cls._enabled``, and
    ``should_wrap_in_hop``'s read of it through the calling thread's own setting."""

    def __init__(self) -> None:
        super().__init__(HOPS, HOPS.replace(".", "/") + ".py")

    def describe(self) -> str:
        return super().describe() + f"; {WRAPPED}.enable() counted, should_wrap_in_hop reads {SWITCH}.own()"

    def edits(self, source: str) -> list[Edit]:
        """In ``enable``: the save (``old_value = cls._enabled``) becomes the override, the store of True enters it,
        the store of the saved value exits it; in ``should_wrap_in_hop`` the read becomes the thread's own."""
        enable, should_wrap = (
            definition(source, self.relpath, f"{WRAPPED}.{name}") for name in ("enable", "should_wrap_in_hop")
        )
        uses = {
            id(node) for node in ast.walk(parse(source)) if isinstance(node, ast.Attribute) and node.attr == "_enabled"
        }
        saves = [node for node in ast.walk(enable) if isinstance(node, ast.Assign) and _is_flag(node.value)]
        stores = [node for node in ast.walk(enable) if isinstance(node, ast.Assign) and _is_flag(node.targets[0])]
        reads = [node for node in ast.walk(should_wrap) if _is_flag(node)]
        setting = [node for node in stores if isinstance(node.value, ast.Constant) and node.value.value is True]
        restoring = [node for node in stores if node not in setting]
        # Refuse any other _enabled attribute: it could be this flag by another name.
        if (
            len(saves) != 1
            or len(setting) != 1
            or len(restoring) != 1
            or len(reads) != 1
            or len(uses) != 4
            or not isinstance(saves[0].targets[0], ast.Name)
            or ast.unparse(restoring[0].value) != saves[0].targets[0].id
        ):
            raise ShapeError(
                f"{self.relpath}: expected {WRAPPED}.enable to save, set and restore cls._enabled and "
                "should_wrap_in_hop to read it, and no other _enabled"
            )
        saved = saves[0].targets[0].id
        return [
            replace_node(saves[0].value, f"{SWITCH}()"),
            replace_node(setting[0], f"{saved}.enter()"),
            replace_node(restoring[0], f"{saved}.exit()"),
            replace_node(reads[0], f"{SWITCH}.own()"),
        ]

    def helpers(self) -> dict[str, object]:
        return {SWITCH: _Wrapping(getattr(importlib.import_module(HOPS), WRAPPED))}

    def per_thread_names(self) -> list[PerThreadName]:
        return [PerThreadName(HOPS, f"{WRAPPED}._enabled", lambda hops: vars(hops)[SWITCH].own())]

    def verify(self) -> None:
        super().verify()
        refuse_accesses_left(self._module, {"LOAD_ATTR", "STORE_ATTR"}, {"_enabled"})


def _is_flag(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "_enabled" and ast.unparse(node.value) == "cls"


class _TwoDeviceMesh:
    """What local_map's deferred path asks of a device mesh: the size of each dimension."""

    def size(self, dim: int | None = None) -> int:
        return 2


def _raised(exc: Exception) -> str:
    return f"raised {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"


def local_map_flags_elsewhere(timeout: float = 60.0) -> Result | None:
    """The main thread traces a local_map op with fake tensors inside ``defer_inlining()`` (deferred: sharded in two,
    local shapes inside). Then thread A waits inside ``defer_inlining()`` and
    ``LocalMapWrappedHigherOrderVariable.enable()``; meanwhile the main thread traces the op again, now outside
    (as another thread's compile does), asks Dynamo whether it would wrap ``local_map`` in the op, and runs the
    backward of its deferred op outside ``defer_inlining()`` (as autograd's device thread would). The trace must
    inline the op's graph, Dynamo must say no, and the backward must give a gradient of the input's shape (it reads
    the setting where it runs); A must see its own settings. None where torch has no local_map op (before 2.10) or no
    ``torch.distributed``."""
    import torch

    if not hasattr(torch_module("torch._higher_order_ops"), "local_map") or not (torch.distributed.is_available()):
        return None
    from torch._dynamo.variables.higher_order_ops import LocalMapWrappedHigherOrderVariable as Wrapped
    from torch._higher_order_ops import local_map
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.experimental._func_map import _local_map_wrapped

    graph = torch.fx.symbolic_trace(lambda x: (x.sin() * 2,))
    graph.meta["local_map_kwargs"] = {
        "in_placements": ((Shard(0),),),
        "out_placements": ((Shard(0),),),
        "device_mesh": _TwoDeviceMesh(),
    }
    fake, seen = FakeTensorMode(), {}
    with local_map.defer_inlining(), fake:  # fake tensors only in this thread: torch 2.10 - 2.11 can crash else
        x = torch.ones(4, requires_grad=True)
        deferred = local_map.local_map_hop(graph, x)[0]

    def own_view() -> None:
        seen["A's own"] = (local_map._DEFER_INLINING, Wrapped.should_wrap_in_hop(_local_map_wrapped))

    with held_elsewhere([local_map.defer_inlining, Wrapped.enable], own_view, timeout):
        try:
            with fake:
                out = local_map.local_map_hop(graph, torch.ones(4))
            seen["the main thread's fake trace"] = f"output shapes {[tuple(o.shape) for o in out]}"
        except Exception as exc:
            seen["the main thread's fake trace"] = _raised(exc)
        seen["Dynamo wraps local_map in the main thread"] = Wrapped.should_wrap_in_hop(_local_map_wrapped)
        try:
            with fake:
                (grad,) = torch.autograd.grad(deferred.sum(), x)
            seen["the backward of the deferred op"] = f"gradient shape {tuple(grad.shape)}"
        except Exception as exc:
            seen["the backward of the deferred op"] = _raised(exc)
    hazard = (
        seen["the main thread's fake trace"] != "output shapes [(4,)]"
        or seen["Dynamo wraps local_map in the main thread"] is not False
        or seen.get("A's own") != (True, True)
        or seen.get("the backward of the deferred op") != "gradient shape (4,)"
    )
    detail = "; ".join(f"{what}: {value}" for what, value in seen.items())
    return Result("local_map flags (defer_inlining / enable in another thread, a trace here)", hazard, detail)


FIX = Fix(
    name="local-map-flags",
    order=320,
    hazard="while one thread is inside local_map's defer_inlining() or LocalMapWrappedHigherOrderVariable.enable(), "
    "other threads' traces through local_map take the deferred path (and fail) and Dynamo wraps their local_map calls",
    versions=releases("2.10"),
    probe=moved_global_probe(LOCAL_MAP, HOLDER, FLAG, f"{LOCAL_MAP} has no {FLAG} (before torch 2.10)"),
    patches=lambda _torch_version: [_DeferPerThread(), _WrappingPerThread()],
    trigger="torch._dynamo",
    scenarios=(
        Scenario(
            local_map_flags_elsewhere,
            releases("2.10"),
            needs="the local_map op (2.10+) and torch.distributed",
            shows="the main thread's fake trace: raised",
        ),
    ),
    shared_state=(
        "the local_map op's `torch._higher_order_ops.local_map._DEFER_INLINING` (set by `defer_inlining()`, read "
        "by its Autograd and Fake kernels) and `LocalMapWrappedHigherOrderVariable._enabled` (set by its "
        "`enable()`, read when Dynamo meets `local_map`) are process-wide"
    ),
    symptom=(
        "while one thread is inside `defer_inlining()` (AutoParallel), other threads' traces through local_map "
        "take the deferred path: a fake-tensor trace raises `AssertionError: actual_bw_inputs must be > 0` (torch"
        " 2.10, 2.13, 2.15); while one is inside `enable()`, Dynamo wraps every thread's `local_map` calls in the"
        " op"
    ),
    releases_note='no local_map op before 2.10: "not needed"',
    caveats=(
        "`local-map-flags` runs the backward of a deferred local_map op (`LocalMapAutogradOp`, which exists only "
        "under `defer_inlining()`) inside `defer_inlining()` itself, since autograd may run it on another thread;"
        " a direct read of `LocalMapWrappedHigherOrderVariable._enabled` in a thread outside `enable()` sees True "
        "while another thread is inside, as without torchfix (Dynamo's own read is the thread's)."
    ),
    survey_rows=(
        "torch/_dynamo/variables/higher_order_ops.py: LocalMapWrappedHigherOrderVariable._enabled",
        "torch/_higher_order_ops/local_map.py: _DEFER_INLINING",
    ),
)
