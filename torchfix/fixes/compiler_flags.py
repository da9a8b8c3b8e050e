"""compiler-flags: ``torch.compiler``'s compile/export flags become per-thread (hazard H3).

``torch.compiler.is_compiling()`` returns the module global ``_is_compiling_flag`` (torch 2.3+), next to
``_is_exporting_flag`` (2.7+) and ``_is_non_strict_tracing_flag`` (2.12+). Export paths set the first two
(``torch.export._trace`` by module attribute, ``torch._export.utils._compiling_state_context`` from 2.7)
and from 2.13 every Dynamo compile sets ``_is_compiling_flag`` for its whole duration
(``_compile_session_context``, entered by ``convert_frame._compile``). As process globals, one thread's
compile makes ``is_compiling()`` True in every other thread, and eager code there (``nn.Module.__call__``'s
hook handling, checkpointing, transformers) takes compile-only paths. All three are still globals in 2.15.

The flags move to per-thread storage (``torch.compiler._compiler_flags_tls``); the functions of
``torch.compiler`` that use them are recompiled, the writers in other modules
(``torch.compiler._is_compiling_flag = True``) are rewritten to the holder, and other readers
(Dynamo's ``variables/torch.py`` from 2.12) reach a module ``__getattr__``. No release imports the
flags by name (``from torch.compiler import _is_compiling_flag``): every outside use is a module attribute.
Dynamo still constant-folds ``is_compiling()`` to True inside compiled code (it matches the function
object, whose identity the ``__code__`` swap keeps).

Where the value must follow a compile to another thread (what we found in torch 2.3 - 2.15):

* The flag is set around the compile of a frame, in the compiling thread. Everything torch runs *for* that
  compile in Python runs there too: Dynamo, AOTAutograd, the joint-graph trace (``torch.autograd.grad`` on
  fake tensors), Inductor's lowering. Inductor's worker pools compile generated code and never read the flag.
* The joint graph's backward nodes run on the compiling thread too, on every device: AOTAutograd builds its
  dispatcher (joint-graph trace included) under ``torch.autograd.set_multithreading_enabled(False)`` in
  every release from 2.0, so autograd runs them on the calling thread rather than on CUDA's device thread.
  Tested: a custom op's fake kernel and its backward formula see True while AOTAutograd traces the joint
  graph, and the backward sees autograd multithreading off (the switch that keeps CUDA work on that thread).
* A lazily compiled backward is compiled at the first ``backward()``, outside any Dynamo compile session:
  upstream does not set the flag there either, so per-thread storage changes nothing for it.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable

from .._fix import Fix, Scenario, SoakCheck, releases
from ..doctor.scenarios import HeldTrace, Result
from ..patching.patches import AttributeUses, ThreadLocalGlobals

MODULE = "torch.compiler"
HOLDER = "_compiler_flags_tls"
FLAGS = {
    "_is_compiling_flag": "is_compiling",  # 2.3+
    "_is_exporting_flag": "is_exporting",  # 2.7+
    "_is_non_strict_tracing_flag": "is_non_strict_tracing",  # 2.12+
}


# Export sets the flags by module attribute: torch.export._trace in 2.3 - 2.6, torch._export.utils from 2.7.
_WRITERS = (
    ("torch.export._trace", "torch/export/_trace.py"),
    ("torch._export.utils", "torch/_export/utils.py"),
)


def _patches(_torch_version: str) -> list:
    newer = frozenset(FLAGS) - {"_is_compiling_flag"}
    return [
        ThreadLocalGlobals(MODULE, "torch/compiler/__init__.py", HOLDER, FLAGS, optional=newer, seen_in_backward=True),
        *(AttributeUses(module, relpath, MODULE, HOLDER, FLAGS) for module, relpath in _WRITERS),
    ]


def _probe() -> str | None:
    if importlib.util.find_spec(MODULE) is None:
        return f"torch has no {MODULE} (before 2.1): no flags to share"
    module = sys.modules.get(MODULE) or __import__(MODULE, fromlist=["_"])
    if isinstance(vars(module).get("_is_compiling_flag"), bool):
        return None
    if HOLDER in vars(module):
        return "torch.compiler's flags are per-thread already"
    return f"{MODULE} has no global _is_compiling_flag (torch before 2.3, or changed upstream)"


def h3_is_compiling_elsewhere(timeout: float = 60.0) -> Result | None:
    """H3: while thread A compiles (its backend held open), ``torch.compiler.is_compiling()`` in thread B.

    From torch 2.13 every Dynamo compile sets the flag (before, only export paths do). None where torch
    has no ``torch.compiler.is_compiling`` (before 2.3).
    """
    import torch

    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if is_compiling is None:
        return None
    with HeldTrace("compile", timeout, probe=is_compiling) as held:
        elsewhere = is_compiling()
    detail = (
        f"is_compiling() during another thread's compile: {elsewhere} (in the compiling thread: {held.seen_inside[0]})"
    )
    return Result("H3 (torch.compile in one thread, is_compiling() in another)", elsewhere, detail)


def soak_leak_probe() -> Callable[[bool], bool]:
    """Whether ``torch.compiler`` says the calling thread compiles or exports."""
    import torch

    compiler = getattr(torch, "compiler", None)  # 2.1+; is_compiling 2.3+, is_exporting 2.4+
    return lambda at_end: any(getattr(compiler, name, bool)() for name in ("is_compiling", "is_exporting"))


FIX = Fix(
    name="compiler-flags",
    order=20,
    hazard="while one thread compiles or exports, torch.compiler.is_compiling() is True in every thread",
    versions=releases("2.3"),
    probe=_probe,
    patches=_patches,
    scenarios=(Scenario(h3_is_compiling_elsewhere, releases("2.13"), needs="torch.compiler.is_compiling (2.3+)"),),
    shared_state=(
        "H3: `torch.compiler._is_compiling_flag` / `_is_exporting_flag` / `_is_non_strict_tracing_flag` are "
        "process globals; from 2.13 every compile sets the first one"
    ),
    symptom=(
        "while one thread compiles or exports, `torch.compiler.is_compiling()` is `True` in every thread, and "
        "eager code there takes compile-only paths"
    ),
    releases_note='no such flags before 2.3: "not needed"',
    soak=SoakCheck(leak_probe=soak_leak_probe),
    survey_rows=(
        "torch/_export/utils.py: torch.compiler._is_compiling_flag / _is_exporting_flag (attr writes)",
        "torch/compiler/__init__.py: _is_compiling_flag",
        "torch/compiler/__init__.py: _is_exporting_flag",
        "torch/compiler/__init__.py: _is_non_strict_tracing_flag",
    ),
)
