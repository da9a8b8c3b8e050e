"""backward-compile-deadlock: compile backward graphs with their forward, not lazily (hazard H5).

AOTAutograd compiles a backward graph lazily, at the first backward. On CUDA that backward runs on
autograd's device thread, and from torch 2.6 Inductor's backward compiler takes Dynamo's
``compile_lock``. If another thread holds ``compile_lock`` in a forward compile meanwhile, it traces
the joint graph through ``torch.autograd.grad`` on fake tensors of the same device, which needs that
same device thread: each waits for the other and the job hangs with no error.

Eager backward lowering compiles the backward inside the forward compile, under the lock the forward
already holds, so nothing compiles on the device thread. torch has the switch from 2.9: a keyword of
``prepare_aot_module_simplified`` (2.9), then ``torch._functorch.config.force_non_lazy_backward_lowering``
(2.10+). From 2.12 config assignments are per-thread, so setting it in the main thread would not reach
the threads that compile; this fix changes the entry's default, which every thread reads.

Cost: a graph compiled for training has its backward compiled up front, also if it is never used.
torch 2.6 - 2.8 have no switch (their eager path, used for graphs that save symbolic ints, compiles
the backward without copying it first, which 2.9 added): there the fix reports "unsupported"; train
with one compiling thread per device, or hold a lock around each thread's first step.
"""

from __future__ import annotations

import importlib

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from .._defaults import ConfigDefault, KeywordDefault
from .._fix import Fix

SWITCH = "force_non_lazy_backward_lowering"
CONFIG = "torch._functorch.config"
AOT = "torch._functorch.aot_autograd"
KEYWORD_FUNCTION = "prepare_aot_module_simplified"  # torch 2.9


def _config_entry() -> object | None:
    return getattr(importlib.import_module(CONFIG), "_config", {}).get(SWITCH)


def _probe() -> str | None:
    import torch

    if Version(str(torch.__version__)).release < (2, 6):
        return "before torch 2.6 the backward compiler does not take compile_lock"
    entry = _config_entry()
    if entry is not None:
        return "eager backward lowering is already the default" if entry.default is True else None
    function = getattr(importlib.import_module(AOT), KEYWORD_FUNCTION, None)
    if function is not None and (function.__kwdefaults__ or {}).get(SWITCH) is True:
        return "eager backward lowering is already the default"
    return None


def _patches(torch_version: str) -> list:
    if Version(torch_version).release >= (2, 10):
        return [ConfigDefault(CONFIG, SWITCH, True)]
    return [KeywordDefault(AOT, KEYWORD_FUNCTION, SWITCH, True)]


FIX = Fix(
    name="backward-compile-deadlock",
    hazard="threads sharing a device deadlock: a lazy backward compile on autograd's device thread waits "
    "for compile_lock held by a forward compile that waits for that device thread",
    versions=SpecifierSet(">=2.9,<2.16", prereleases=True),
    probe=_probe,
    patches=_patches,
)
