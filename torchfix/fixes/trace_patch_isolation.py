"""trace-patch-isolation: FX tracing patches act only in the tracing thread (hazard H4).

While ``Tracer.trace`` runs, it patches ``torch.nn.Module.__call__`` and ``__getattr__``, the functions
registered with ``torch.fx.wrap`` and the "autowrapped" ones it finds in the traced code's globals
(``math.sqrt`` ...), by writing into the class or the module dict: process-wide. Every other thread then runs
the tracer's wrappers: an eager module call in another thread goes to this tracer's ``call_module``
("NameError: module is not installed as a submodule"), and two tracers overlapping in time restore each
other's patches out of order (a trace that runs on with its patches gone, or patches left in place after
both finished). From 2.5 the active patcher is also a global, ``CURRENT_PATCHER``, and two overlapping
traces trip "AssertionError: CURRENT_PATCHER is None in finally block" or revert the other thread's patcher
(``_maybe_revert_all_patches``, entered by Dynamo for every frame it compiles). Present in every release
up to 2.15 (upstream pytorch/pytorch#187589 is not in a release yet).

The fix routes every patch through ``_thread_patches``, a per-slot dispatcher (a slot is one name in one
class or module dict):

* the first thread to patch a slot puts a dispatcher function there; each thread keeps its own stack of
  patches per slot; the dispatcher calls the calling thread's latest patch, or the original when that
  thread has none, so other threads run the originals; the last thread to revert restores the original;
* the tracer's own reads of a slot (the deduplication check, the original it wraps, the autowrap scan)
  see the calling thread's view, never another thread's patch or the dispatcher;
* ``CURRENT_PATCHER`` (2.5+) becomes per-thread.

The edits replace one statement or expression each, on its own line, in ``_PatchedFn*.patch/revert``,
``_Patcher.patch/patch_method`` (2.0 - 2.4 write there directly), ``_patch_wrapped_functions``,
``_create_wrapped_method`` and ``_autowrap_check``.
"""

from __future__ import annotations

import ast
import builtins
import sys
import threading
import types
from collections.abc import Callable

import wrapt

from .._fix import Fix, Scenario, releases
from .._patch import ThreadLocalGlobals
from .._selftest import MODULE_GRAPH, HeldTrace, Result, graph_ops, module_around
from .._source import Edit, ShapeError, definitions, replace_node, segment

MODULE = "torch.fx._symbolic_trace"
HELPER = "_thread_patches"
_ABSENT = object()


class _Slot:
    """One patched name of one owner (a module dict, or a class) while any thread has it patched."""

    def __init__(self, owner: dict | type, name: str) -> None:
        self.owner, self.name = owner, name
        self.saved = owner.get(name, _ABSENT) if isinstance(owner, dict) else vars(owner).get(name, _ABSENT)
        if isinstance(owner, dict):  # a name absent from a module dict resolves to the builtin (_PatchedFnDel)
            self.original = getattr(builtins, name) if self.saved is _ABSENT else self.saved
        else:
            self.original = getattr(owner, name)  # may be inherited
        self.patches = 0  # over all threads

    def write(self, value: object) -> None:
        if isinstance(self.owner, dict):
            self.owner[self.name] = value
        else:
            setattr(self.owner, self.name, value)

    def restore(self) -> None:
        if self.saved is not _ABSENT:
            self.write(self.saved)
        elif isinstance(self.owner, dict):
            del self.owner[self.name]
        else:
            delattr(self.owner, self.name)


class ThreadPatches:
    """The tracer's patches, kept per thread; what torch's ``_symbolic_trace`` calls instead of writing slots."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict[tuple[int, str], _Slot] = {}
        self._local = threading.local()

    def _stack(self, key: tuple[int, str]) -> list[Callable]:
        stacks = self._local.__dict__.setdefault("stacks", {})
        return stacks.setdefault(key, [])

    def set(self, owner: dict | type, name: str, new_fn: Callable) -> None:
        """Patch ``owner[name]`` (``owner.name`` for a class) for the calling thread only."""
        key = (id(owner), name)
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _Slot(owner, name)
                slot.write(self._dispatcher(key, slot))
            slot.patches += 1
            self._stack(key).append(new_fn)

    def _dispatcher(self, key: tuple[int, str], slot: _Slot) -> Callable:
        # A plain function, so that as a class attribute (Module.__call__) it binds like the original.
        def dispatch(*args: object, **kwargs: object) -> object:
            return (self._top(key) or slot.original)(*args, **kwargs)

        # Where Dynamo traces a call to it (eager torch.cond compiles its branches while another thread
        # traces), it inlines this instead, as it does for torch.compile's own wrappers: the original.
        if isinstance(slot.original, types.FunctionType):
            dispatch._torchdynamo_inline = slot.original
        return dispatch

    def unset(self, owner: dict | type, name: str) -> None:
        """Undo the calling thread's latest patch of the slot (a thread's patchers nest, so it is theirs)."""
        key = (id(owner), name)
        with self._lock:
            stack = self._stack(key)
            if not stack:
                return
            stack.pop()
            slot = self._slots[key]
            slot.patches -= 1
            if slot.patches == 0:
                slot.restore()
                del self._slots[key]

    def _top(self, key: tuple[int, str]) -> Callable | None:
        stack = self._local.__dict__.get("stacks", {}).get(key)
        return stack[-1] if stack else None

    def current(self, owner: dict | type, name: str) -> object:
        """``owner[name]`` (``getattr(owner, name)``) as the calling thread sees it: its patch, or the original."""
        slot = self._slots.get((id(owner), name))
        if slot is None:
            return owner[name] if isinstance(owner, dict) else getattr(owner, name)
        return self._top((id(owner), name)) or slot.original

    def items(self, frame_dict: dict) -> list[tuple[str, object]]:
        """``frame_dict.items()`` as the calling thread sees them (a list: the caller patches the dict)."""
        return [(name, self.current(frame_dict, name)) for name in list(frame_dict)]


# Every dispatcher runs this code object. Dynamo must run it as plain Python, like the torch code it
# stands in for: it cannot trace a threading.local, and would compile it as a frame of its own for each
# module it forwards to (torch <= 2.2 runs compiled graphs through Module.__call__).
_DISPATCH_CODE = next(c for c in ThreadPatches._dispatcher.__code__.co_consts if isinstance(c, types.CodeType))


def _skip_in_dynamo(eval_frame: types.ModuleType) -> None:
    eval_frame.skip_code(_DISPATCH_CODE)


_skip_hook_registered = False  # one post-import hook per process, however often the fix is installed


def _skip_in_dynamo_when_imported() -> None:
    """Skip the dispatcher in Dynamo now, or when Dynamo is imported. A skipped code object stays skipped
    after uninstall, which is harmless (nothing runs it then); wrapt cannot remove a hook, so it is
    registered once rather than once per install."""
    global _skip_hook_registered
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None:
        _skip_in_dynamo(eval_frame)
    elif not _skip_hook_registered:
        _skip_hook_registered = True
        wrapt.register_post_import_hook(_skip_in_dynamo, "torch._dynamo.eval_frame")


def _slot_write(source: str, stmt: ast.stmt) -> tuple[str, str, str | None] | None:
    """``(owner, name, value)`` texts of ``owner[name] = value`` or ``setattr(owner, name, value)``;
    value None for ``del owner[name]``. None for any other statement."""

    def text(node: ast.AST) -> str:
        return segment(source, node)

    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Subscript):
        return text(stmt.targets[0].value), text(stmt.targets[0].slice), text(stmt.value)
    if isinstance(stmt, ast.Delete) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Subscript):
        return text(stmt.targets[0].value), text(stmt.targets[0].slice), None
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "setattr":
        return tuple(text(arg) for arg in call.args)  # type: ignore[return-value]
    return None


class _IsolationPatch(ThreadLocalGlobals):
    PATCH_KINDS = ("_PatchedFnSetItem", "_PatchedFnDel", "_PatchedFnSetAttr")

    def __init__(self) -> None:
        super().__init__(
            MODULE,
            "torch/fx/_symbolic_trace.py",
            "_current_patcher_tls",
            {"CURRENT_PATCHER": "patcher"},
            optional=frozenset({"CURRENT_PATCHER"}),  # 2.5+
        )

    def describe(self) -> str:
        return super().describe() + f"; adds {HELPER}, which keeps the tracer's patches per thread"

    def edits(self, source: str) -> list[Edit]:
        functions = definitions(source)
        missing = {"_Patcher.patch", "_Patcher.patch_method", "_autowrap_check"} - functions.keys()
        if missing:
            raise ShapeError(f"{self.relpath}: no {', '.join(sorted(missing))}")
        edits = super().edits(source)  # CURRENT_PATCHER, where the file has it
        for qualname, func in functions.items():
            kind, _, method = qualname.partition(".")
            if kind in self.PATCH_KINDS and method in ("patch", "revert"):
                edits.append(self._write_edit(source, func, method))
            elif qualname in ("_Patcher.patch", "_Patcher.patch_method"):  # 2.0 - 2.4 write the slot here
                edits += [self._write_edit(source, stmt, "patch") for stmt in func.body if _slot_write(source, stmt)]
        edits += self._read_edits(source, functions)
        return edits

    @staticmethod
    def _write_edit(source: str, node: ast.FunctionDef | ast.stmt, method: str) -> Edit:
        stmt = node.body[0] if isinstance(node, ast.FunctionDef) else node
        write = _slot_write(source, stmt)
        if write is None or (isinstance(node, ast.FunctionDef) and len(node.body) != 1):
            raise ShapeError(f"line {stmt.lineno}: expected one write of a patched name")
        owner, name, value = write
        if method == "revert":
            return replace_node(stmt, f"{HELPER}.unset({owner}, {name})")
        return replace_node(stmt, f"{HELPER}.set({owner}, {name}, {value})")

    @staticmethod
    def _read_edits(source: str, functions: dict[str, ast.FunctionDef]) -> list[Edit]:
        """The tracer's reads of patched names: through the calling thread's view."""
        edits = []
        readers = ("_Patcher.patch", "_Patcher.patch_method", "_patch_wrapped_functions", "_create_wrapped_method")
        for qualname in readers:
            for node in ast.walk(functions[qualname]):
                if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                    owner, name = node.value, node.slice  # frame_dict[name]
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
                    if len(node.args) != 2 or not isinstance(node.args[1], ast.Name):
                        continue  # getattr(fn, "__fx_already_patched", False): not a slot
                    owner, name = node.args  # getattr(cls, name)
                else:
                    continue
                # getattr(builtins, name) names no slot: a patched builtin lives in the frame dict.
                if (
                    isinstance(owner, ast.Name)
                    and owner.id != "builtins"
                    and isinstance(name, ast.Name)
                    and name.id == "name"
                ):
                    edits.append(replace_node(node, f"{HELPER}.current({owner.id}, name)"))
        items = [
            node
            for node in ast.walk(functions["_autowrap_check"])
            if isinstance(node, ast.Call) and segment(source, node) == "frame_dict.items()"
        ]
        if len(items) != 1:
            raise ShapeError("_autowrap_check: expected one frame_dict.items()")
        return edits + [replace_node(items[0], f"{HELPER}.items(frame_dict)")]

    def helpers(self) -> dict[str, object]:
        return {HELPER: ThreadPatches()}

    def _install_state(self, module: types.ModuleType, source: str) -> None:
        super()._install_state(module, source)
        _skip_in_dynamo_when_imported()


def _probe() -> str | None:
    module = sys.modules.get(MODULE) or __import__(MODULE, fromlist=["_"])
    if HELPER in vars(module):
        return "FX tracing patches are per-thread already"
    if not hasattr(module, "_Patcher"):
        return f"{MODULE} has no _Patcher (FX patches torch differently in this release)"
    return None


def _module_slots() -> dict[str, object]:
    """What ``Tracer.trace`` patches on ``nn.Module``: must be the originals again once no trace runs."""
    import torch

    return {name: vars(torch.nn.Module)[name] for name in ("__call__", "__getattr__")}


def h4_trace_patches_leak(action: str, timeout: float = 60.0) -> Result | None:
    """H4: thread A holds a ``symbolic_trace`` of a module open while the main thread does ``action``:

    * ``eager_module``: calls a module eagerly (without the fix it runs A's patched ``Module.__call__``);
    * ``symbolic_trace``: a third thread starts its own trace, held open until A has finished (they overlap
      without nesting: without the fix A reverts B's patcher, B finds ``CURRENT_PATCHER`` None);
    * ``cond``: runs ``torch.cond`` eagerly (it compiles its branches with Dynamo).

    The hazard shows as an error in either thread, a wrong graph, or ``nn.Module`` left patched.
    None for ``cond`` where torch has no ``torch.cond``.
    """
    import torch

    if action == "cond" and not hasattr(torch, "cond"):
        return None
    slots = _module_slots()
    errors: list[str] = []
    graphs: list[list[str]] = []
    held = HeldTrace("symbolic_trace_module", timeout).__enter__()
    other: HeldTrace | None = None
    try:
        if action == "eager_module":
            torch.nn.Linear(2, 2)(torch.ones(2))
        elif action == "symbolic_trace":
            other = HeldTrace("symbolic_trace_module", timeout).__enter__()
        else:
            torch.cond(torch.tensor(True), lambda x: x.sin(), lambda x: x.cos(), (torch.ones(2),))  # 2.2: no builtins
    except Exception as exc:
        errors.append(f"main thread: {exc!r}")
    for trace in (held, other):  # A finishes first
        if trace is not None:
            trace.__exit__(RuntimeError, None, None)  # errors are collected here, not raised
            errors += [f"{trace.thread.name}: {exc!r}" for exc in trace.errors]
            graphs.append(trace.graph_ops)
    wrong = [ops for ops in graphs if ops != MODULE_GRAPH]
    leaked = [name for name, value in _module_slots().items() if value is not slots[name]]
    problems = errors + [f"wrong graph {ops}" for ops in wrong] + [f"nn.Module.{name} left patched" for name in leaked]
    return Result(f"H4 ({action} in one thread while another traces)", bool(problems), "; ".join(problems) or "ok")


def concurrent_tracers(threads: int = 4, rounds: int = 5, timeout: float = 60.0) -> Result:
    """H4 under load: ``threads`` threads ``symbolic_trace`` a module at once, every round; a barrier inside
    the traced code makes all of them be inside their traces together, and they finish in any order.
    """
    slots = _module_slots()
    barrier = threading.Barrier(threads, timeout=timeout)
    problems: list[str] = []

    def in_every_trace(x):
        barrier.wait()
        return x + 1

    def tracer() -> None:
        for _ in range(rounds):
            try:
                ops = graph_ops(module_around(in_every_trace))
                if ops != MODULE_GRAPH:
                    problems.append(f"wrong graph {ops}")
            except threading.BrokenBarrierError:
                return  # another thread failed first and broke the barrier; its error is recorded
            except Exception as exc:
                problems.append(repr(exc))
                barrier.abort()
                return

    workers = [threading.Thread(target=tracer, name=f"tracer-{i}", daemon=True) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout)
    if any(worker.is_alive() for worker in workers):
        raise TimeoutError("a tracer thread did not finish")
    problems += [
        f"nn.Module.{name} left patched" for name, value in _module_slots().items() if value is not slots[name]
    ]
    traces = threads * rounds
    detail = f"{len(problems)} problem(s): {'; '.join(problems[:3])}" if problems else f"all {traces} traces correct"
    return Result(f"H4 x{traces} ({threads} threads tracing at once, {rounds} rounds)", bool(problems), detail)


FIX = Fix(
    name="trace-patch-isolation",
    order=30,
    hazard="an FX trace in one thread patches nn.Module.__call__/__getattr__ and wrapped functions for every thread",
    versions=releases("2.0"),
    probe=_probe,
    patches=lambda _torch_version: [_IsolationPatch()],
    scenarios=(
        Scenario(h4_trace_patches_leak, releases("2.0"), args=("eager_module",)),
        Scenario(h4_trace_patches_leak, releases("2.0"), args=("cond",), needs="torch.cond", stage=1),
        Scenario(h4_trace_patches_leak, releases("2.0"), args=("symbolic_trace",), stage=1),
    ),
)
