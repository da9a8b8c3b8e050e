"""compile-cache-recheck: a thread that waited for another thread's compile reuses it (cold-start duplicates).

Dynamo looks a frame up in its cache (in C, without a lock) and, on a miss, compiles it under
``convert_frame.compile_lock``. N threads that reach the same cold compiled function together all miss:
the first compiles while the others wait for the lock, and each of them then compiles the same frame
again. N compiles and N interchangeable cache entries instead of one (an H200 with torch 2.11: 3 training
threads compiled 6 graphs instead of 2). Serialised under the lock, the copies add up to the cold start
of every thread but the first.

The fix looks the frame up once more after the lock is taken, just before compiling: the cache entries of
the frame's code for this backend (and, from 2.13, this ``isolate_recompiles`` region), and the results of
compiles that returned but whose entries Dynamo has not installed yet (it does so after the callback, so
after the lock is released): the first whose guards pass on the frame's locals. Found, it is returned as the
compile's result, so no compile happens; Dynamo's C side installs it as one more cache entry (it always
installs what the callback returns: no API adds a cache hit without an entry). That copy costs a list node,
not a compile, and the entry count per frame is what it was without the fix (one per racing thread), so
recompile limits trip no earlier. The guards are the ones the lookup itself runs, so a reused entry is one
the lookup would have picked; anything unexpected in the re-check falls back to compiling, torch's own path.

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

from packaging.specifiers import SpecifierSet

from .._fix import Fix
from .._patch import SourcePatch
from .._source import Edit, ShapeError, parse, replace_node, segment

MODULE = "torch._dynamo.convert_frame"
HELPER = "_compile_unless_cached"
# The attribute that leads from Dynamo's callback to the backend: 2.6 - 2.9, then 2.10+.
BACKEND_ATTRS = ("_torchdynamo_orig_callable", "_torchdynamo_orig_backend")


class CacheRecheck:
    """``_compile_unless_cached``: wraps the compile that Dynamo's callback runs under ``compile_lock``."""

    def __init__(self) -> None:
        self.reused = 0  # compiles avoided in this process (read by tests and the doctor)
        # Compiles that returned but may not be in the cache yet: Dynamo installs the entry after the
        # callback returns, so after the lock is released. A weak reference to the GuardedCode lives
        # exactly that long: the new cache entry copies its fields and drops it. Guarded by compile_lock.
        self._in_flight: list[tuple[types.CodeType, object, weakref.ref]] = []

    def __call__(self, callback: object, backend_attr: str) -> Callable:
        """The compile ``callback.<backend_attr>(frame, ...)``, preceded by a cache lookup."""
        convert = getattr(callback, backend_attr)
        backend = _backend(callback, backend_attr)

        def compile_unless_cached(frame: object, *args: object, **kwargs: object) -> object:
            self._in_flight = [item for item in self._in_flight if item[2]() is not None]
            cached = self._lookup(backend, frame)
            if cached is not None:
                return cached
            result = convert(frame, *args, **kwargs)
            guarded = getattr(result, "guarded_code", result)  # 2.7+: a ConvertFrameReturn around it
            if type(guarded).__name__ == "GuardedCode":
                self._in_flight.append((frame.f_code, backend, weakref.ref(guarded)))
            return result

        return compile_unless_cached

    def _lookup(self, backend: object, frame: object) -> object | None:
        from torch._C._dynamo import eval_frame as c_eval_frame
        from torch._dynamo import types as dynamo_types

        try:
            code = frame.f_code
            installed = [
                dynamo_types.GuardedCode(entry.code, entry.guard_manager, entry.compile_id, entry.trace_annotation)
                for entry in _entries(c_eval_frame, code)
                if _same_backend(entry.backend, backend)
            ]
            in_flight = [ref() for c, b, ref in self._in_flight if c is code and _same_backend(b, backend)]
            for guarded in installed + [g for g in in_flight if g is not None]:
                if guarded.guard_manager.check(frame.f_locals):
                    self.reused += 1
                    wrap = getattr(dynamo_types, "wrap_guarded_code", None)  # 2.7+: a ConvertFrameReturn
                    return wrap(guarded) if wrap else guarded
        except Exception:  # a cache we cannot read the way we expect: compile, as torch would
            return None
        return None


def _backend(callback: object, attr: str) -> object:
    """The backend Dynamo keys cache entries by: the end of the callback's chain of wrapped backends
    (``get_backend`` in Dynamo's C code walks the same attribute). Should torch key them otherwise
    (precompile cache keys), nothing matches and the frame compiles as before."""
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
        tree = parse(source)
        wrapper = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CatchErrorsWrapper"), None)
        call = (
            next((f for f in wrapper.body if isinstance(f, ast.FunctionDef) and f.name == "__call__"), None)
            if wrapper
            else None
        )
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

    def _install_state(self, module: types.ModuleType) -> None:
        if HELPER in vars(module):
            raise ShapeError(f"{MODULE} has a {HELPER} already")
        vars(module)[HELPER] = CacheRecheck()

    def _remove_state(self, module: types.ModuleType) -> None:
        vars(module).pop(HELPER, None)


def _probe() -> str | None:
    module = importlib.import_module(MODULE)
    return "the cache is re-checked after compile_lock already" if HELPER in vars(module) else None


FIX = Fix(
    name="compile-cache-recheck",
    hazard="threads that miss Dynamo's cache together each compile the same frame again after the first "
    "one's compile (N threads, N compiles)",
    versions=SpecifierSet(">=2.6,<2.16", prereleases=True),
    probe=_probe,
    patches=lambda _torch_version: [_RecheckPatch()],
    trigger=MODULE,
    hazard_is_cost=True,
)
