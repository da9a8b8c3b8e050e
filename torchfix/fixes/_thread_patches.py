"""Patches of a name that act only in the thread that made them: a per-thread dispatcher in the patched slot.

Some torch code patches a function for the whole process while it works, by writing into a class or a module
dict, and puts the original back at its end: ``Tracer.trace`` patches ``nn.Module.__call__`` and the traced code's
globals (trace-patch-isolation), ``torch.compiler._patch_engine_backward()`` patches
``torch.autograd._engine_run_backward`` (autograd-entry-patches). Every other thread then runs the patch, and two
threads patching one slot restore each other's values out of order. A fix rewrites those writes to a
:class:`ThreadPatches` (the torch module holds it as a helper, one per fix; :class:`PatchWritesPerThread` rewrites
the common shape, a function that saves, writes and in ``finally`` restores a module attribute):

* the first thread to patch a slot (one name in one class or module dict) puts a dispatcher function there; each
  thread keeps its own stack of patches per slot; the dispatcher calls the calling thread's latest patch, or the
  original when that thread has none, so other threads run the originals; the last thread to unpatch restores the
  original;
* reads of the slot by the patching code itself (the original it wraps) go through :meth:`ThreadPatches.current`,
  the calling thread's view, never another thread's patch or the dispatcher.

Each fix has an instance of its own, fresh when it is applied and gone when it is reverted, so that one fix's
uninstall cannot leave stale slots in another's. Their slots differ (``nn.Module``'s methods and the globals of
traced code; ``torch.autograd``'s functions; ``torch.fx.graph_module._forward_from_src``, graph-module-build).
Every dispatcher runs one code object, which Dynamo is told to skip (:func:`skip_in_dynamo_when_imported`).
"""

from __future__ import annotations

import ast
import builtins
import sys
import threading
import types
from collections.abc import Callable

import wrapt

from .._patch import SourcePatch
from .._source import Edit, ShapeError, definitions, replace_node, segment
from .._thread_stash import ThreadSpaces

HELPER = "_thread_patches"  # the name of a fix's ThreadPatches in the torch module it edits

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
        self._spaces = ThreadSpaces("thread-patches")  # autograd's device thread runs a backward with its thread's

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


def _skip_in_dynamo(eval_frame: types.ModuleType) -> None:
    eval_frame.skip_code(_DISPATCH_CODE)


_skip_hook_registered = False  # one post-import hook per process, however often the fix is installed


def skip_in_dynamo_when_imported() -> None:
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


def _slot(attribute: str) -> str:
    """``torch.autograd.grad`` -> ``vars(torch.autograd), "grad"``: the slot as ThreadPatches takes it."""
    owner, _, name = attribute.rpartition(".")
    return f'vars({owner}), "{name}"'


def _in_finally(function: ast.FunctionDef) -> set[int]:
    """The ids of the statements in the ``finally:`` blocks of ``function``."""
    return {
        id(stmt)
        for node in ast.walk(function)
        if isinstance(node, ast.Try)
        for block in node.finalbody
        for stmt in ast.walk(block)
    }


class PatchWritesPerThread(SourcePatch):
    """Functions of one torch module that patch module attributes for the process while they run, rewritten so
    that their patches act in the calling thread only.

    Each function (``patchers``: its name -> the attributes it patches, as torch's source spells them, say
    ``torch.autograd.grad``) must read the first attribute once (the original it saves or wraps), write each
    attribute once, and write each once more in a ``finally:`` block (the restore): the read becomes
    :meth:`ThreadPatches.current`, the write :meth:`ThreadPatches.set`, the restore :meth:`ThreadPatches.unset`
    of ``_thread_patches``, the module's :class:`ThreadPatches`. Any other shape is refused. Functions of
    ``patchers`` the file lacks are left out (releases add them); one of them at least must be there.
    """

    def __init__(self, module: str, relpath: str, patchers: dict[str, tuple[str, ...]]) -> None:
        super().__init__(module, relpath)
        self.patchers = patchers

    def edits(self, source: str) -> list[Edit]:
        functions = definitions(source)
        present = [name for name in self.patchers if name in functions]
        if not present:
            raise ShapeError(f"{self.relpath}: none of {', '.join(self.patchers)}")
        return [edit for name in present for edit in self._patcher_edits(source, functions[name])]

    def _patcher_edits(self, source: str, function: ast.FunctionDef) -> list[Edit]:
        slots = self.patchers[function.name]
        restores, edits = _in_finally(function), []
        found = {(attribute, kind): 0 for attribute in slots for kind in ("read", "write", "restore")}
        for node in ast.walk(function):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = segment(source, node.targets[0])
                if target in slots:
                    kind = "restore" if id(node) in restores else "write"
                    call = "unset" if kind == "restore" else "set"
                    value = "" if kind == "restore" else f", {segment(source, node.value)}"
                    edits.append(replace_node(node, f"{HELPER}.{call}({_slot(target)}{value})"))
                    found[target, kind] += 1
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                attribute = segment(source, node)
                if attribute in slots:
                    edits.append(replace_node(node, f"{HELPER}.current({_slot(attribute)})"))
                    found[attribute, "read"] += 1
        expected = {key: int(key[1] != "read" or key[0] == slots[0]) for key in found}
        if found != expected:
            wrong = ", ".join(
                f"{n} {kind}(s) of {attribute}"
                for (attribute, kind), n in found.items()
                if n != expected[attribute, kind]
            )
            raise ShapeError(f"{self.relpath} {function.name}: expected one read, write and restore, found {wrong}")
        return edits

    def describe(self) -> str:
        slots = ", ".join(dict.fromkeys(slot for slots in self.patchers.values() for slot in slots))
        return super().describe() + f"; adds {HELPER}: the patches of {slots} act in the patching thread only"

    def helpers(self) -> dict[str, object]:
        return {HELPER: ThreadPatches()}

    def _install_state(self, module: types.ModuleType, source: str) -> None:
        skip_in_dynamo_when_imported()  # the dispatchers, where Dynamo meets them
