"""propagate_config(): compile settings made in one thread apply in every thread (hazard H6).

From torch 2.12 every entry of torch's config modules (``torch._dynamo.config``, ``torch._inductor.config``,
``torch._functorch.config``, ...) keeps the value a user sets in a ``ContextVar`` (``_ConfigEntry.user_override``,
pytorch/pytorch#186537). A new thread starts with an empty context, so ``torch._dynamo.config.recompile_limit = 3``
in the main thread is invisible to worker threads, and to the threads of autograd's engine where lazily
compiled backward graphs are compiled (those are not Python threads: no one can hand them a context).

This is not a patch: per-thread config is upstream's intent (``config.patch()`` in one thread must not
leak into another). What is missing is a way to say "these settings are the process's". A ``ContextVar``'s
default is what every context that never set it reads, so ``propagate_config()`` re-creates the entries the
calling thread has set, with that value as the default: every thread that has not set the entry itself,
whenever it started and whatever runs it, reads the value as a user setting (``_is_default`` says False,
so saved configs, repro scripts and cache keys see it). A thread's own settings and ``config.patch()``
blocks keep working per thread on top.
"""

from __future__ import annotations

import sys
from contextvars import ContextVar


def config_is_per_thread() -> bool:
    """Whether this torch keeps config values per thread (2.12+)."""
    import torch._dynamo.config as dynamo_config

    entry = next(iter(getattr(dynamo_config, "_config", {None: None}).values()))
    return isinstance(getattr(entry, "user_override", None), ContextVar)  # before 2.4 entries are plain values


def propagate_config() -> list[str]:
    """Make the settings of torch's config modules made in the calling thread apply in every thread.

    Call it after configuring and outside any ``config.patch()`` block, preferably before starting the
    workers (a thread that already computed a config hash keeps it until it changes a setting itself).
    Returns the settings propagated (``"torch._dynamo.config.recompile_limit"``, ...); on torch before
    2.12, where config is process-wide already, nothing is needed and it returns ``[]``.
    """
    if not config_is_per_thread():
        return []
    import torch.utils._config_module as config_module

    propagated = []
    for module in list(sys.modules.values()):
        if not isinstance(module, config_module.ConfigModule):
            continue
        changed = False
        for name, entry in module._config.items():
            value = entry.user_override.get()
            # Aliases store their value in the entry they point to; unset and default values need nothing.
            if entry.alias is not None or value is config_module._UNSET_SENTINEL or value == entry.default:
                continue
            entry.user_override = ContextVar(entry.user_override.name, default=value)
            propagated.append(f"{module.__name__}.{name}")
            changed = True
        if changed:
            invalidate_config_caches(module)
    return propagated


def invalidate_config_caches(module: object) -> None:
    """A config module caches its hash (part of compile cache keys) and dict copies; an assignment marks
    them dirty, a change of entries or defaults does not: mark the calling thread's as an assignment would."""
    if hasattr(module, "_hash_dirty_var"):  # 2.13+: per-thread caches
        module._hash_dirty_var.set(True)
        module._get_dict_dirty_keys_var.set(None)
    else:  # up to 2.12: one process-wide hash cache
        module._is_dirty = True
