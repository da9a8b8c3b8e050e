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

Edit: in ``CatchErrorsWrapper.__call__`` the backend call under ``compile_lock`` becomes
``_compile_unless_cached.cached(self, "<backend attribute>", frame) or _compile_unless_cached.remember(self,
"<backend attribute>", frame, <the backend call>)``: the backend is still called from torch's frame, as Dynamo's
stack walks expect. torch 2.6 - 2.15
(``GuardedCode`` holds a ``guard_manager`` from 2.6); before 2.6 the fix reports "unsupported" (without a warning: the
copies cost time, they break nothing). Applied when
``torch._dynamo.convert_frame`` is first imported (importing Dynamo at ``import torchfix`` would slow
every program down).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import threading
import types
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result, fresh_add_one
from ..patching.patches import SourcePatch
from ..patching.source import Edit, definition, find_replaced, insert_at, replace_node, segment

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
    """``_compile_unless_cached``: the compile that Dynamo's callback runs under ``compile_lock``, preceded by a
    cache lookup. The edit calls it as ``cached(...) or remember(..., <torch's own call>)``, so that no frame of
    torchfix is on the stack while Dynamo compiles: Dynamo reads the stack there (the ``skip=1`` of tracebacks;
    from 2.13, whether the caller is a non-recursive ``torch.compiler.disable`` wrapper, found by walking back
    over ``convert_frame.py``'s frames). Dynamo's results are objects without ``__bool__`` or ``__len__``: the
    ``or`` takes a reused one as it is."""

    def __init__(self) -> None:
        self.reused = 0  # compiles avoided in this process (read by tests and the doctor)
        self._compiled: list[_Compiled] = []  # guarded by compile_lock, like everything else here

    def cached(self, callback: object, backend_attr: str, frame: object) -> object | None:
        """An earlier compile's result for ``frame`` and the callback's backend whose guards pass now, or None."""
        self._compiled = [c for c in self._compiled if c.guard_manager() is not None]
        return self._lookup(_backend(callback, backend_attr), frame)

    def remember(self, callback: object, backend_attr: str, frame: object, result: object) -> object:
        """Note the compile that produced ``result`` (while its result lives) and return ``result``."""
        guarded = getattr(result, "guarded_code", result)  # 2.7+: a ConvertFrameReturn around it
        if type(guarded).__name__ == "GuardedCode":
            refs = weakref.ref(guarded), weakref.ref(guarded.guard_manager)
            self._compiled.append(_Compiled(frame.f_code, _backend(callback, backend_attr), *refs))
        return result

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
        call = definition(source, self.relpath, "CatchErrorsWrapper.__call__")
        blocks = [
            block
            for block in ast.walk(call)
            if isinstance(block, ast.With)
            and [segment(source, item.context_expr) for item in block.items]
            == ["compile_lock", "_disable_current_modes()"]
        ]
        (compile_call,) = find_replaced(
            self.relpath,
            blocks,
            "backend call under compile_lock",
            lambda node: (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in BACKEND_ATTRS
                and segment(source, node.func.value) == "self"
                and node.args
            ),
        )
        attr, frame = compile_call.func.attr, segment(source, compile_call.args[0])
        # ``<call>`` becomes ``cached(...) or remember(..., <call>)``: torch's own call, in torch's own frame.
        return [
            replace_node(
                compile_call.func,
                f"{HELPER}.cached(self, {attr!r}, {frame}) or {HELPER}.remember(self, {attr!r}, {frame}, self.{attr}",
            ),
            insert_at(compile_call.end_lineno, compile_call.end_col_offset, ")"),
        ]

    def helpers(self) -> dict[str, object]:
        return {HELPER: CacheRecheck()}


def _probe() -> str | None:
    module = importlib.import_module(MODULE)
    return "the cache is re-checked after compile_lock already" if HELPER in vars(module) else None


class _ObservedLock:
    """Dynamo's ``compile_lock``, noting which threads asked for it before they block on it. It only
    observes: the real lock does the locking. (Looking at the other threads' stacks instead can crash
    torch 2.11 on Python 3.11: a thread in Dynamo's callback sits on top of a frame not started yet.)"""

    def __init__(self, lock: object) -> None:
        self.lock = lock
        self.waiting: set[int] = set()
        self.changed = threading.Condition()

    def __enter__(self) -> object:
        with self.changed:
            self.waiting.add(threading.get_ident())
            self.changed.notify_all()
        return self.lock.__enter__()

    def __exit__(self, *exc_info: object) -> object:
        return self.lock.__exit__(*exc_info)

    def __getattr__(self, name: str) -> object:  # acquire, release, ...
        return getattr(self.lock, name)

    def wait_for(self, threads: list[threading.Thread], timeout: float) -> None:
        """Until every one of ``threads`` has started and then asked for the lock (or ended). A thread not
        started yet is not alive either: without the ``ident`` check it would count as ended."""
        with self.changed:
            self.changed.wait_for(
                lambda: all(t.ident is not None and (t.ident in self.waiting or not t.is_alive()) for t in threads),
                timeout,
            )


@contextlib.contextmanager
def _observed_compile_lock() -> Iterator[_ObservedLock]:
    import importlib

    # The module whose functions take it: convert_frame from torch 2.4, eval_frame before.
    modules = map(importlib.import_module, ("torch._dynamo.convert_frame", "torch._dynamo.eval_frame"))
    module = next(m for m in modules if "compile_lock" in vars(m))
    observed = module.compile_lock = _ObservedLock(module.compile_lock)
    try:
        yield observed
    finally:
        module.compile_lock = observed.lock


def duplicate_compiles(
    threads: int = 3,
    timeout: float = 60.0,
    sizes: tuple[int, ...] | None = None,
    backends: tuple[int, ...] | None = None,
) -> Result:
    """Cold start: one thread compiles a function while ``threads - 1`` others call it. Their cache lookups
    miss, they wait for ``compile_lock``, and then each compiles the same frame again, unless the cache is
    looked up once more after the lock (the first compile is held open until every other thread waits).

    Thread i calls with a tensor of ``sizes[i]`` elements (default 2) through ``torch.compile`` with backend
    number ``backends[i]`` (default 0). A thread whose input or backend differs from every compile before
    it must compile its own; only the others may reuse. Every thread checks its result."""
    import torch

    sizes = sizes or (2,) * threads
    backends = backends or (0,) * threads
    compiled_by: list[str] = []
    first_compile = threading.Event()
    callers: list[threading.Thread] = []
    errors: list[BaseException] = []

    def held_backend(gm, example_inputs):
        compiled_by.append(threading.current_thread().name)
        if len(compiled_by) == 1:
            first_compile.set()
            lock.wait_for(callers, timeout)  # every other thread missed the cache and waits for the lock
        return gm.forward

    def other_backend(gm, example_inputs):  # a backend that is not held_backend (Dynamo compares with ==)
        return held_backend(gm, example_inputs)

    fresh = fresh_add_one()  # its own cache and recompile limit
    compiled = [torch.compile(fresh, backend=held_backend), torch.compile(fresh, backend=other_backend)]

    def call(size: int, backend: int) -> None:
        try:
            x = torch.arange(float(size))
            if not torch.equal(compiled[backend](x), x + 1):
                raise AssertionError(f"wrong result for {size} elements")
        except BaseException as exc:
            errors.append(exc)

    started = [
        threading.Thread(target=call, args=(sizes[i], backends[i]), name=f"compile-{i}", daemon=True)
        for i in range(threads)
    ]
    first, callers[:] = started[0], started[1:]
    with _observed_compile_lock() as lock:
        first.start()
        if not first_compile.wait(timeout):
            raise TimeoutError("the first thread never started compiling")
        for thread in callers:
            thread.start()
        for thread in started:
            thread.join(timeout)
    if errors:
        raise errors[0]
    needed = len(set(zip(sizes, backends)))
    detail = (
        f"{len(compiled_by)} compiles of one function by {threads} threads starting together "
        f"({needed} different input/backend pair(s))"
    )
    return Result(f"cold start ({threads} threads, one function)", len(compiled_by) > needed, detail)


FIX = Fix(
    name="compile-cache-recheck",
    order=50,
    hazard="threads that miss Dynamo's cache together each compile the same frame again after the first "
    "one's compile (N threads, N compiles)",
    versions=releases("2.6"),
    probe=_probe,
    patches=lambda _torch_version: [_RecheckPatch()],
    trigger=MODULE,
    hazard_is_cost=True,
    scenarios=(
        # Below 2.6 (no fix), whether threads duplicate a compile varies (2.2 does; 2.0 runs the waiting threads
        # uncompiled); 2.10 - 2.11 can crash (SIGSEGV) duplicating one, and, with the fix too, when a thread
        # recompiles a frame that others wait to run (its ``sizes`` and ``backends`` calls): seen in the matrix.
        Scenario(duplicate_compiles, releases("2.6"), args=(3,), needs_fix=True, crashes=releases("2.10", "2.11")),
    ),
    shared_state=(
        "cold start: threads that miss Dynamo's cache together wait for `compile_lock`, then each compiles the "
        "same frame again"
    ),
    symptom=(
        "N threads starting together compile every graph N times (on an H200, 3 trainer threads compiled 6 graphs"
        " instead of 2); on torch 2.10 – 2.11 the duplicate compiles can crash the process (SIGSEGV)"
    ),
    releases_note='before 2.6: "unsupported", without a warning, since it costs time but breaks nothing',
    caveats=(
        "It looks the frame up in Dynamo's cache once more after `compile_lock` is taken (including compiles that"
        " returned but whose entry Dynamo has not installed yet), with the guards the lookup itself runs; a "
        "thread that waited for another's compile then reuses it. It applies when Dynamo is first imported, since"
        " `import torch` does not load Dynamo."
    ),
)
