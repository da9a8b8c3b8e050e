"""install / uninstall / status: the lifecycle of all fixes in this process.

If torch is imported already, fixes apply at once. If not, a post-import hook (``patching.imports``) applies them the
moment ``import torch`` finishes, so the import order never matters: either way the same patches run
on a fully imported torch, and the ``__code__`` swap reaches references taken before. A fix whose
trigger is a part of torch that ``import torch`` does not load (Dynamo) waits for that import the same way,
and its module is imported only then (``fixes.ROSTER`` says what waits for what without importing them).
"""

from __future__ import annotations

import os
import sys
import threading
import types
import warnings
from collections.abc import Callable

from . import fixes
from ._errors import TorchfixError, TorchfixWarning
from ._fix import Fix, FixStatus, Patch, State, revert_all
from .patching.imports import when_imported

_lock = threading.RLock()
_statuses: dict[str, FixStatus] = {}
_applied: list[tuple[Fix, list[Patch]]] = []
_installed = False
# Bumped by uninstall: a hook registered by an earlier install() that fires later finds itself stale
# and does nothing.
_generation = 0


def _strict() -> bool:
    return os.environ.get("TORCHFIX_STRICT", "").strip().lower() in {"1", "true", "yes"}


def _complain(message: str) -> None:
    if _strict():
        raise TorchfixError(message)
    warnings.warn(message, TorchfixWarning, stacklevel=4)


def disabled_fixes() -> set[str]:
    """Names of the fixes TORCHFIX_DISABLE turns off: ``1`` (or ``all``) for all, else ``name,name``."""
    value = os.environ.get("TORCHFIX_DISABLE", "").strip()
    known = {entry.name for entry in fixes.ROSTER}
    if value.lower() in {"", "0", "false", "no"}:
        return set()
    if value.lower() in {"1", "true", "yes", "all"}:
        return known
    names = {name.strip() for name in value.split(",") if name.strip()}
    if names - known:
        _complain(
            f"TORCHFIX_DISABLE names unknown fixes {sorted(names - known)}; known: {sorted(known)}. "
            "Those names are ignored."
        )
    return names & known


def _set(status: FixStatus) -> None:
    _statuses[status.name] = status


def install() -> list[FixStatus]:
    """Apply every fix this torch needs (now, or when its trigger module is imported). Idempotent."""
    global _installed
    with _lock:
        if _installed:
            return status()
        _installed = True
        off = disabled_fixes()
        for entry in fixes.ROSTER:
            if entry.name in off:
                _set(FixStatus(entry.name, State.DISABLED, "TORCHFIX_DISABLE"))
        waiting: dict[str, list[fixes.Entry]] = {}
        for entry in fixes.ROSTER:
            if entry.name not in off:
                waiting.setdefault(entry.trigger, []).append(entry)
        if "torch" in sys.modules:
            _arm(waiting)
        else:
            for group in waiting.values():
                for entry in group:
                    _set(FixStatus(entry.name, State.PENDING, f"applied when {entry.trigger} is imported"))
            _when_imported("torch", lambda: _arm(waiting))
        return status()


def _arm(waiting: dict[str, list[fixes.Entry]]) -> None:
    """With torch imported: apply the fixes whose trigger module is loaded, and wait for the others'.

    A trigger module this torch does not have (CUDA graph trees before 2.1) makes its fixes "not needed":
    a hook on it would wait for ever."""
    for trigger, group in waiting.items():
        if trigger in sys.modules:
            _apply(group)
        elif not module_file_exists(trigger):
            for entry in group:
                _set(FixStatus(entry.name, State.NOT_NEEDED, f"this torch has no {trigger}"))
        else:
            for entry in group:
                _set(FixStatus(entry.name, State.PENDING, f"applied when {trigger} is imported"))
            _when_imported(trigger, lambda group=group: _apply(group))


def module_file_exists(name: str) -> bool:
    """Whether a submodule of an imported package has a file, without importing it (``find_spec`` would
    import its parent packages, and ``torch._inductor`` costs an import of its own)."""
    top, *rest = name.split(".")
    base = os.path.join(os.path.dirname(sys.modules[top].__file__), *rest)
    return os.path.exists(base + ".py") or os.path.exists(os.path.join(base, "__init__.py"))


def _when_imported(module: str, action: Callable[[], None]) -> None:
    """Run ``action`` once ``module`` is imported, unless uninstall() was called meanwhile."""
    generation = _generation

    def on_import(_module: object) -> None:
        with _lock:
            if generation == _generation and _installed:  # else uninstalled since (maybe reinstalled)
                action()

    when_imported(module, on_import)


def _apply(active: list[fixes.Entry]) -> None:
    import torch

    version = str(torch.__version__)
    for entry in active:
        fix = fixes.fix_of(entry.module)
        fix_status, patches = fix.apply(version)
        _set(fix_status)
        if patches:
            _applied.append((fix, patches))
        elif fix_status.state is State.UNSUPPORTED and not fix.hazard_is_cost:
            _complain(f"torchfix: {fix_status.name} not applied: {fix_status.reason}. Hazard: {fix.hazard}.")


def uninstall() -> list[FixStatus]:
    """Restore torch's original code and state, and cancel fixes still waiting for ``import torch``."""
    global _installed, _generation
    with _lock:
        _installed = False
        _generation += 1
        while _applied:
            _fix, patches = _applied.pop()
            revert_all(patches)
        for entry in fixes.ROSTER:
            _set(FixStatus(entry.name, State.NOT_INSTALLED, "uninstall() was called"))
        return status()


def fixes_by_code() -> dict[types.CodeType, list[str]]:
    """The fixes applied now, by the code objects that run their patched code (``Patch.patched_code``)."""
    found: dict[types.CodeType, list[str]] = {}
    with _lock:
        for fix, patches in _applied:
            for patch in patches:
                for code in patch.patched_code():
                    found.setdefault(code, []).append(fix.name)
    return found


def status() -> list[FixStatus]:
    """One entry per known fix, in application order."""
    with _lock:
        return [
            _statuses.get(entry.name, FixStatus(entry.name, State.NOT_INSTALLED, "install() was not called"))
            for entry in fixes.ROSTER
        ]
