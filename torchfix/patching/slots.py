"""Patches of a name that act only in the thread that made them: a per-thread dispatcher in the patched slot.

Some torch code patches a function for the whole process while it works, by writing into a class or a module
dict, and puts the original back at its end: ``Tracer.trace`` patches ``nn.Module.__call__`` and the traced code's
globals (trace-patch-isolation), ``torch.compiler._patch_engine_backward()`` patches
``torch.autograd._engine_run_backward`` (autograd-entry-patches), ``enable_torchbind_tracing()`` and ``MetaTracer``
patch ``torch.ScriptMethod.__call__`` and ``torch.zeros`` (process-wide-patches), non-strict export a tensor
subclass's ``__getattribute__`` (export-subclass-getattr). Every other thread then runs the patch, and two threads
patching one slot restore each other's values out of order. A fix rewrites those writes to a :class:`ThreadPatches`
(the torch module holds it as a helper, one per fix; :class:`SlotPatches` makes the edits where one function
patches, restores in ``finally`` and reads one slot):

* the first thread to patch a slot (one name in one class or module dict) puts a dispatcher function there; each
  thread keeps its own stack of patches per slot; the dispatcher calls the calling thread's latest patch, or the
  original when that thread has none, so other threads run the originals; the last thread to unpatch restores the
  original;
* reads of the slot by the patching code itself (the original it wraps) go through :meth:`ThreadPatches.current`,
  the calling thread's view, never another thread's patch or the dispatcher.

Each fix has an instance of its own, fresh when it is applied and gone when it is reverted, so that one fix's
uninstall cannot leave stale slots in another's. Their slots differ (``nn.Module``'s methods and the globals of
traced code; ``torch.autograd``'s functions; ``torch.ScriptMethod``, ``torch``'s constructors, a subclass). Every
dispatcher runs one code object, which Dynamo is told to skip (:func:`skip_in_dynamo_when_imported`).
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import sys
import threading
import types
from collections.abc import Callable, Iterator

from .imports import when_imported
from .patches import SourcePatch, source_without_import
from .source import Edit, ShapeError, definitions, find_replaced, parse, replace_node, segment
from .stash import ThreadSpaces

_ABSENT = object()
HELPER = "_thread_patches"  # the ThreadPatches' name in a patched module (SlotPatches)


def in_finally(function: ast.FunctionDef) -> set[int]:
    """The ids of the statements in the ``finally:`` blocks of ``function``: where torch restores what it patched."""
    return {
        id(stmt)
        for node in ast.walk(function)
        if isinstance(node, ast.Try)
        for block in node.finalbody
        for stmt in ast.walk(block)
    }


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
        self._spaces = ThreadSpaces("thread-patches", seen_in_backward=True)  # a backward runs with its thread's

    def _stack(self, key: tuple[int, str]) -> list[Callable]:
        space = self._spaces.make()
        if not hasattr(space, "stacks"):
            space.stacks = {}
        return space.stacks.setdefault(key, [])

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

    @contextlib.contextmanager
    def patched(self, owner: dict | type, name: str, new_fn: Callable) -> Iterator[Callable]:
        """``unittest.mock.patch`` of ``owner[name]`` (``owner.name``), for the calling thread only."""
        self.set(owner, name, new_fn)
        try:
            yield new_fn
        finally:
            self.unset(owner, name)

    def _top(self, key: tuple[int, str]) -> Callable | None:
        stack = getattr(self._spaces.get(), "stacks", {}).get(key)
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
# stands in for: it cannot trace torch's thread-local stash, and would compile it as a frame of its own for each
# module it forwards to (torch <= 2.2 runs compiled graphs through Module.__call__).
_DISPATCH_CODE = next(c for c in ThreadPatches._dispatcher.__code__.co_consts if isinstance(c, types.CodeType))


def seen_by_this_thread(value: object) -> object:
    """What ``value`` calls in the calling thread if it is a dispatcher (its patch, or the original); else
    ``value``. The watcher (``torchfix watch``) compares slots so: a dispatcher is shared, what it calls is not."""
    if getattr(value, "__code__", None) is not _DISPATCH_CODE:
        return value
    cells = dict(zip(_DISPATCH_CODE.co_freevars, (cell.cell_contents for cell in value.__closure__)))
    return cells["self"]._top(cells["key"]) or cells["slot"].original


def _skip_in_dynamo(eval_frame: types.ModuleType) -> None:
    eval_frame.skip_code(_DISPATCH_CODE)


_skip_hook_registered = False  # one post-import hook per process, however often the fix is installed


def skip_in_dynamo_when_imported() -> None:
    """Skip the dispatcher in Dynamo now, or when Dynamo is imported. A skipped code object stays skipped
    after uninstall, which is harmless (nothing runs it then); the hook is registered once rather than once per
    install."""
    global _skip_hook_registered
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None:
        _skip_in_dynamo(eval_frame)
    elif not _skip_hook_registered:
        _skip_hook_registered = True
        when_imported("torch._dynamo.eval_frame", _skip_in_dynamo)


class SlotPatches(SourcePatch):
    """A torch function that patches a slot while it works and restores it after, made to patch per thread: its
    writes of ``owner.attr`` (``setattr(owner, name, value)`` where ``attr`` is None: a module's names by variable),
    its restores in ``finally`` and its reads of the slot go through ``_thread_patches``, a :class:`ThreadPatches`
    in the module. ``owner`` None: any owner (a class in a variable). ``function``: a qualified name (``Class.f``) or
    the name of a nested function. ``bind``: torch writes a descriptor (``functools.partialmethod``), which the
    dispatcher calls as the class attribute gives it (``value.__get__(None, owner)``). A release that lacks the
    module gets no edits."""

    may_be_absent = True

    def __init__(
        self, module: str, function: str, owner: str | None, attr: str | None, reads: int, bind: bool = False
    ) -> None:
        super().__init__(module, module.replace(".", "/") + ".py")
        self.function, self.owner, self.attr, self.reads, self.bind = function, owner, attr, reads, bind

    def describe(self) -> str:
        return super().describe() + f"; adds {HELPER}, which keeps {self.function}'s patches per thread"

    def _slot(self, owner: str, name: str) -> str | None:
        """The slot as ThreadPatches takes it, from the texts of an owner and a name (``'"attr"'`` for
        ``owner.attr``); None where that is not the slot."""
        if self.owner is not None and owner != self.owner:
            return None
        if self.attr is None:  # setattr(torch, name, ...), getattr(torch, name)
            return None if name.startswith('"') else f"vars({owner}), {name}"
        return f"{owner}, {name}" if name == f'"{self.attr}"' else None

    def _function(self, source: str) -> ast.FunctionDef:
        found = definitions(source).get(self.function)
        if found is not None:
            return found
        (nested,) = find_replaced(
            self.relpath,
            parse(source),
            f"function {self.function}",
            lambda node: isinstance(node, ast.FunctionDef) and node.name == self.function,
        )
        return nested

    @staticmethod
    def _use(source: str, node: ast.AST) -> tuple[str, str, ast.expr | None] | None:
        """The texts of owner and name, and the value, of a write by ``node`` (``owner.attr = value``,
        ``setattr(owner, name, value)``); value None for a read (``owner.attr``, ``getattr(owner, name)``); None
        for any other node. A name written as an attribute comes quoted (``'"attr"'``)."""

        def call_of(node: ast.AST, function: str, args: int) -> list[ast.expr] | None:
            is_call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == function
            return node.args if is_call and len(node.args) == args else None

        def text(node: ast.AST) -> str:
            return segment(source, node)

        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Attribute):
            return text(node.targets[0].value), f'"{node.targets[0].attr}"', node.value
        if isinstance(node, ast.Expr) and (args := call_of(node.value, "setattr", 3)):
            return text(args[0]), text(args[1]), args[2]
        if args := call_of(node, "getattr", 2):
            return text(args[0]), text(args[1]), None
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            return text(node.value), f'"{node.attr}"', None
        return None

    def edits(self, source: str) -> list[Edit]:
        function = self._function(source)
        restores, edits = in_finally(function), {"write": [], "restore": [], "read": []}
        for node in ast.walk(function):
            use = self._use(source, node)
            slot = self._slot(*use[:2]) if use else None
            if slot is None:
                continue
            owner, _, value = use
            if value is None:
                edits["read"].append(replace_node(node, f"{HELPER}.current({slot})"))
            elif id(node) in restores:
                edits["restore"].append(replace_node(node, f"{HELPER}.unset({slot})"))
            else:
                patch = segment(source, value) + (f".__get__(None, {owner})" if self.bind else "")
                edits["write"].append(replace_node(node, f"{HELPER}.set({slot}, {patch})"))
        counts = {kind: len(kind_edits) for kind, kind_edits in edits.items()}
        if counts != {"write": 1, "restore": 1, "read": self.reads}:
            raise ShapeError(
                f"{self.relpath} {self.function}: expected one write and restore, {self.reads} reads of "
                f"the slot; found {counts}"
            )
        return [edit for kind_edits in edits.values() for edit in kind_edits]

    def apply(self) -> None:
        if source_without_import(self.module_name) is not None:
            super().apply()

    def verify(self) -> None:
        if source_without_import(self.module_name) is not None:
            super().verify()

    def helpers(self) -> dict[str, object]:
        return {HELPER: ThreadPatches()}

    def _install_state(self, module: types.ModuleType, source: str) -> None:
        skip_in_dynamo_when_imported()
