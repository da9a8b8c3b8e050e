"""Patches that change a default rather than code: a torch config entry's default, a keyword default.

They follow the same contract as the source patches (apply / revert / verify / describe), so a fix can
mix both kinds, and ``python -m torchfix diff`` lists them in the diff header.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable

from .config import invalidate_config_caches
from .source import ShapeError

_UNSET = object()


class _DefaultChange:
    """What both kinds share: they always change something, and change no text (their diff-header line,
    ``describe()``, says it all)."""

    patched = True

    def diff(self, read_source: Callable[[str], str]) -> str:
        return ""

    def per_thread_names(self) -> list:
        return []  # a default is the process's, for every thread

    def patched_code(self) -> set:
        return set()  # a config entry's default: what reads it is torch's config module, for every entry


class ConfigDefault(_DefaultChange):
    """The process-wide default of a ``torch.utils._config_module`` entry, for every thread.

    From torch 2.12 a config assignment (``torch._functorch.config.x = v``) is a per-thread override
    (a ContextVar): other threads, autograd's device threads among them, never see it. The entry's
    ``default`` is what every thread without an override of its own reads, so that is what we change.
    An explicit user setting still wins, in the thread that made it.
    """

    def __init__(self, module: str, name: str, value: object) -> None:
        self.module_name, self.name, self.value = module, name, value
        self._saved: object = _UNSET

    def describe(self) -> str:
        return f"{self.module_name}.{self.name}: default {self.value!r} for every thread (config entry default)"

    def _entry(self) -> object:
        module = importlib.import_module(self.module_name)
        entry = getattr(module, "_config", {}).get(self.name)
        if entry is None or not hasattr(entry, "default"):
            raise ShapeError(f"{self.module_name} has no config entry {self.name}")
        return entry

    def apply(self) -> None:
        entry = self._entry()
        self._saved, entry.default = entry.default, self.value
        invalidate_config_caches(importlib.import_module(self.module_name))

    def revert(self) -> None:
        if self._saved is not _UNSET:
            self._entry().default = self._saved
            invalidate_config_caches(importlib.import_module(self.module_name))
            self._saved = _UNSET

    def verify(self) -> None:
        # A thread started now has no override of its own: it must read the new default.
        module = importlib.import_module(self.module_name)
        seen: list[object] = []
        thread = threading.Thread(target=lambda: seen.append(getattr(module, self.name)), name="torchfix-verify")
        thread.start()
        thread.join()
        if seen != [self.value]:
            raise ShapeError(f"{self.module_name}.{self.name} reads {seen} in a new thread, not {self.value!r}")


class KeywordDefault(_DefaultChange):
    """The default of a keyword-only parameter of a torch function (``__kwdefaults__``)."""

    def __init__(self, module: str, function: str, parameter: str, value: object) -> None:
        self.module_name, self.function, self.parameter, self.value = module, function, parameter, value
        self._saved: object = _UNSET

    def describe(self) -> str:
        return f"{self.module_name}.{self.function}(*, {self.parameter}={self.value!r}): keyword default"

    def _defaults(self) -> dict:
        function = getattr(importlib.import_module(self.module_name), self.function, None)
        defaults = getattr(function, "__kwdefaults__", None) or {}
        if self.parameter not in defaults:
            raise ShapeError(f"{self.module_name}.{self.function} has no keyword-only {self.parameter}")
        return defaults

    def apply(self) -> None:
        defaults = self._defaults()
        self._saved, defaults[self.parameter] = defaults[self.parameter], self.value

    def revert(self) -> None:
        if self._saved is not _UNSET:
            self._defaults()[self.parameter] = self._saved
            self._saved = _UNSET

    def patched_code(self) -> set:
        return {getattr(importlib.import_module(self.module_name), self.function).__code__}

    def verify(self) -> None:
        if self._defaults()[self.parameter] != self.value:
            raise ShapeError(f"{self.module_name}.{self.function}: {self.parameter} default did not change")
