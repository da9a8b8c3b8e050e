"""compile-cache-recheck: a thread that waited for another thread's compile reuses it (cold-start duplicates).

Dynamo looks a frame up in its cache (in C, without a lock) and, on a miss, compiles it under
``convert_frame.compile_lock``. N threads that reach the same cold compiled function together all miss:
the first compiles while the others wait for the lock, and each of them then compiles the same frame
again. N compiles and N interchangeable cache entries instead of one (an H200 with torch 2.11: 3 training
threads compiled 6 graphs instead of 2). Serialised under the lock, the copies add up to the cold start
of every thread but the first.

The fix looks the frame up once more after the lock is taken, just before compiling. It remembers the
compiles made through it (frame, backend, result) for as long as their result lives: in flight (Dynamo
installs the cache entry after the callback returns, so after the lock is released) or as a cache entry (a
guard manager dies with its entry, so ``torch._dynamo.reset()`` ends the reuse too). The first of them for
this frame and backend (compared as Dynamo compares backends) whose guards pass on the frame's locals is
returned as the compile's result, so no compile happens; Dynamo's C side installs it as one more cache entry
(it always installs what the callback returns: no API adds a cache hit without an entry). That copy costs a
list node, not a compile, and the entry count per frame is what it was without the fix (one per racing
thread), so recompile limits trip no earlier. The guards are the ones the lookup itself runs; anything
unexpected in the re-check falls back to compiling, torch's own path. (Cache entries expose their backend
only from torch 2.7, so entries made before ``import torchfix`` are not reused.)

Edit: in ``CatchErrorsWrapper.__call__`` the compile under ``compile_lock`` calls
``_compile_unless_cached(self, "<the backend attribute>")(...)`` instead of the backend. torch 2.6 - 2.15
(``GuardedCode`` holds a ``guard_manager`` from 2.6); before 2.6 the fix reports "unsupported" (without a warning: the
copies cost time, they break nothing). Applied when
``torch._dynamo.convert_frame`` is first imported (importing Dynamo at ``import torchfix`` would slow
every program down).
"""

from __future__ import annotations

import ast
import importlib
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from .._fix import Fix, Scenario, releases
from .._patch import SourcePatch
from .._source import Edit, ShapeError, definitions, replace_node, segment

MODULE = "torch._dynamo.convert_frame"
HELPER = "_compile_unless_cached"
# The attribute that leads from Dynamo's callback to the backend: 2.6 - 2.9, then 2.10+.
BACKEND_ATTRS = ("_torchdynamo_orig_callable", "_torchdynamo_orig_backend")


@dataclass(frozen=True)
class _Compiled:
    """A compile made through ``_compile_unless_cached``, while its result may still be reused."""

    frame_code: types.CodeType
    backend: object
    guarded: weakref.ref  # the GuardedCode: alive until Dynamo has copied it into a cache entry
    guard_manager: weakref.ref  # alive while the cache entry is (a reset drops it)


class CacheRecheck:
    """``_compile_unless_cached``: wraps the compile that Dynamo's callback runs under ``compile_lock``."""

    def __init__(self) -> None:
        self.reused = 0  # compiles avoided in this process (read by tests and the doctor)
        self._compiled: list[_Compiled] = []  # guarded by compile_lock, like everything else here

    def __call__(self, callback: object, backend_attr: str) -> Callable:
        """The compile ``callback.<backend_attr>(frame, ...)``, preceded by a cache lookup."""
        convert = getattr(callback, backend_attr)
        backend = _backend(callback, backend_attr)

        def compile_unless_cached(frame: object, *args: object, **kwargs: object) -> object:
            self._compiled = [c for c in self._compiled if c.guard_manager() is not None]
            cached = self._lookup(backend, frame)
            if cached is not None:
                return cached
            result = convert(frame, *args, **kwargs)
            guarded = getattr(result, "guarded_code", result)  # 2.7+: a ConvertFrameReturn around it
            if type(guarded).__name__ == "GuardedCode":
                refs = weakref.ref(guarded), weakref.ref(guarded.guard_manager)
                self._compiled.append(_Compiled(frame.f_code, backend, *refs))
            return result

        return compile_unless_cached

    def _lookup(self, backend: object, frame: object) -> object | None:
        """A GuardedCode of an earlier compile of this frame for this backend whose guards pass now."""
        from torch._C._dynamo import eval_frame as c_eval_frame
        from torch._dynamo import types as dynamo_types

        try:
            code = frame.f_code
            mine = [c for c in self._compiled if c.frame_code is code and _same_backend(c.backend, backend)]
            if not mine:
                return None
            installed = {id(entry.guard_manager): entry for entry in _entries(c_eval_frame, code)}
            for compiled in mine:
                guarded, guard_manager = compiled.guarded(), compiled.guard_manager()
                entry = installed.get(id(guard_manager))
                if guarded is None and entry is not None:  # in the cache now: rebuild it from the entry
                    guarded = dynamo_types.GuardedCode(
                        entry.code, guard_manager, entry.compile_id, entry.trace_annotation
                    )
                if guarded is not None and guard_manager.check(frame.f_locals):
                    self.reused += 1
                    wrap = getattr(dynamo_types, "wrap_guarded_code", None)  # 2.7+: a ConvertFrameReturn
                    return wrap(guarded) if wrap else guarded
        except Exception:  # a cache we cannot read the way we expect: compile, as torch would
            return None
        return None


def _backend(callback: object, attr: str) -> object:
    """The end of the callback's chain of wrapped backends, as ``get_backend`` in Dynamo's C code walks it:
    what a compile made through the fix is remembered by, and compared with (:func:`_same_backend`)."""
    while hasattr(callback, attr):
        callback = getattr(callback, attr)
    return callback


def _same_backend(saved: object, backend: object) -> bool:
    """Dynamo's own test (``backend_match``): identity, else ``==`` (two ``torch.compile`` calls with the
    same backend and options share cache entries), where an ``__eq__`` that raises means no."""
    try:
        return saved is backend or bool(saved == backend)
    except Exception:
        return False


def _entries(c_eval_frame: types.ModuleType, code: types.CodeType) -> list:
    """The cache entries a lookup of ``code`` would try now, in its order."""
    region = getattr(c_eval_frame, "_get_cache_entries_for_region", None)
    if region is None:  # before 2.13: one list per code object
        return list(c_eval_frame._debug_get_cache_entry_list(code))
    current = c_eval_frame.get_eval_frame_isolate_recompiles_id()
    # An isolated region's lookup falls back to the default region (-1), read-only.
    return list(region(code, current)) + (list(region(code, -1)) if current >= 0 else [])


class _RecheckPatch(SourcePatch):
    def __init__(self) -> None:
        super().__init__(MODULE, "torch/_dynamo/convert_frame.py")

    def describe(self) -> str:
        return super().describe() + f"; adds {HELPER}, which re-checks the cache before compiling"

    def edits(self, source: str) -> list[Edit]:
        call = definitions(source).get("CatchErrorsWrapper.__call__")
        if call is None:
            raise ShapeError(f"{self.relpath}: no CatchErrorsWrapper.__call__")
        compiles = [
            node.func
            for block in ast.walk(call)
            if isinstance(block, ast.With)
            and [segment(source, item.context_expr) for item in block.items]
            == ["compile_lock", "_disable_current_modes()"]
            for node in ast.walk(block)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in BACKEND_ATTRS
            and segment(source, node.func.value) == "self"
        ]
        if len(compiles) != 1:
            raise ShapeError(f"{self.relpath}: expected one backend call under compile_lock, found {len(compiles)}")
        attr = compiles[0].attr
        return [replace_node(compiles[0], f"{HELPER}(self, {attr!r})")]

    def helpers(self) -> dict[str, object]:
        return {HELPER: CacheRecheck()}


def _probe() -> str | None:
    module = importlib.import_module(MODULE)
    return "the cache is re-checked after compile_lock already" if HELPER in vars(module) else None


FIX = Fix(
    name="compile-cache-recheck",
    hazard="threads that miss Dynamo's cache together each compile the same frame again after the first "
    "one's compile (N threads, N compiles)",
    versions=releases("2.6"),
    probe=_probe,
    patches=lambda _torch_version: [_RecheckPatch()],
    trigger=MODULE,
    hazard_is_cost=True,
    scenarios=(
        # Below 2.6 (no fix), whether threads duplicate a compile varies (2.2 does; 2.0 runs the waiting threads
        # uncompiled); 2.10 - 2.11 can crash (SIGSEGV) duplicating one.
        Scenario("duplicate_compiles", releases("2.6"), args=(3,), needs_fix=True, crashes=releases("2.10", "2.11")),
    ),
)
