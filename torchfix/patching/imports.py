"""Post-import hooks: run a function the moment a module's import finishes (``when_imported``).

A finder first on ``sys.meta_path`` answers only for the modules a hook waits for: it finds the module's spec with
the finders behind it and wraps its loader, whose ``exec_module`` runs the module's code and then its hooks. The
module gets its own loader back before its code runs (``__loader__``, ``__spec__.loader``), so nothing that reads
them sees the wrapper. Hooks of a module already imported run at once. Written here rather than taken from wrapt
because importing wrapt cost more than the rest of ``import torchfix`` but the patching (8 ms of about 50 on the CPU
machine, many times that where its bytecode is not compiled).
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
import types
from collections.abc import Callable

_lock = threading.RLock()
_waiting: dict[str, list[Callable[[types.ModuleType], None]]] = {}  # module name -> hooks not yet run
_finding = threading.local()  # .names: the modules this thread's finder is looking up (the finders behind it)


def when_imported(name: str, hook: Callable[[types.ModuleType], None]) -> None:
    """Call ``hook(module)`` once the module ``name`` is imported: now if it is, else right after its import."""
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _waiting.setdefault(name, []).append(hook)
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
            return
    hook(module)


def _imported(module: types.ModuleType) -> None:
    with _lock:
        hooks = _waiting.pop(module.__name__, [])
    for hook in hooks:
        hook(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object, target: types.ModuleType | None = None) -> object:
        if name not in _waiting:
            return None
        finding = _finding.__dict__.setdefault("names", set())
        if name in finding:
            return None
        finding.add(name)
        try:
            spec = next(
                (
                    spec
                    for finder in list(sys.meta_path)
                    if finder is not self and hasattr(finder, "find_spec")
                    for spec in (finder.find_spec(name, path, target),)
                    if spec is not None
                ),
                None,
            )
        finally:
            finding.discard(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _HookedLoader(spec.loader)
        return spec


class _HookedLoader(importlib.abc.Loader):
    """A module's loader that runs the module's hooks after its code."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: object) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = self.loader
        if getattr(module.__spec__, "loader", None) is self:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        _imported(module)


_FINDER = _Finder()
