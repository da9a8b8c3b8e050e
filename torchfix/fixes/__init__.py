"""Every fix torchfix knows: each module of this package whose name does not start with "_" defines one, ``FIX``.

``ALL`` lists them in the order they apply (and revert in reverse): by ``Fix.order``, then by name. A new fix is a
new module here; nothing else names it.

Importing the fix modules is most of what ``import torchfix`` costs beside the patching, and most of them wait
for a part of torch that a program may never import (Dynamo, export). So ``import torchfix`` reads the
``ROSTER`` (each fix's module, name, order and trigger, in ``ALL``'s order: kept in torchfix's cache, made by
importing every module where the cache has none) and imports a fix's module when it applies it (``fix_of``);
``ALL``, ``MODULE_OF`` and the modules as attributes of this package (``fixes.fx_tracing_flag``) import them on
first use.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import NamedTuple

from .._fix import Fix
from ..patching.cache import cached, rebuilt_on_failure


class Entry(NamedTuple):
    """What ``install()`` and ``status()`` know of a fix before its module is imported."""

    module: str  # "torchfix.fixes.fx_tracing_flag"
    name: str  # "fx-tracing-flag"
    order: int
    trigger: str


def _module_names() -> list[str]:
    return [f"{__name__}.{m.name}" for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]


def _discover() -> dict[str, Fix]:
    """Each fix module's ``FIX``, keyed by the module's name, in ``ALL``'s order."""
    found = {module: fix_of(module) for module in _module_names()}
    return dict(sorted(found.items(), key=lambda item: (item[1].order, item[1].name)))


def fix_of(module: str) -> Fix:
    """The ``FIX`` of a fix module (``Entry.module``), imported now if it was not."""
    return importlib.import_module(module).FIX


def _roster() -> list[Entry]:
    """Every fix's entry, from the cache (whose key holds torchfix's files, so its entry was made by the modules it
    describes); one that is not a row for each fix module raises, and ``rebuilt_on_failure`` makes it again."""

    def make() -> list[tuple]:
        return [tuple(Entry(module, fix.name, fix.order, fix.trigger)) for module, fix in _discover().items()]

    entries = [Entry(*row) for row in cached("fixes", (), make)]
    kinds = (str, str, int, str)
    if sorted(e.module for e in entries) != sorted(_module_names()) or not all(
        isinstance(value, kind) for entry in entries for value, kind in zip(entry, kinds)
    ):
        raise ValueError("the cached roster of fixes does not name every fix module")
    return entries


ROSTER: list[Entry] = rebuilt_on_failure(_roster)


def __getattr__(name: str) -> object:
    """``ALL`` and ``MODULE_OF``, and a fix module by its name, imported on first use (PEP 562)."""
    if name == "ALL":
        return list(_loaded().values())
    if name == "MODULE_OF":  # "fx-tracing-flag" -> its module
        return {fix.name: module for module, fix in _loaded().items()}
    if f"{__name__}.{name}" in {entry.module for entry in ROSTER}:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_all: dict[str, Fix] = {}


def _loaded() -> dict[str, Fix]:
    if not _all:
        _all.update(_discover())
    return _all
