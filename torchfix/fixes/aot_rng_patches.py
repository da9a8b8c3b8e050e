"""aot-rng-patches: AOTAutograd's patches of ``torch.cuda.set_rng_state`` / ``get_rng_state`` act in the compiling
thread only.

Every AOTAutograd compile (every training graph ``torch.compile`` makes, every export to ATen) collects the graph's
metadata with ``unittest.mock.patch("torch.cuda.set_rng_state", lambda *args: None)`` around it
(``torch/_functorch/aot_autograd.py``): setting an RNG state from fake tensors makes no sense. ``mock.patch`` writes
the ``torch.cuda`` module attribute, for the whole process, so while one thread collects metadata every other
thread's ``torch.cuda.set_rng_state(...)`` silently does nothing: ``torch.utils.checkpoint`` restores the CUDA RNG
state that way before it recomputes a checkpointed region, so a backward in another thread at that moment
recomputes dropout with other random numbers than its forward used, and its gradients are wrong, without a word.
With functionalized RNG (``torch._functorch.config.functionalize_rng_ops``) the joint and forward traces patch
``get_rng_state`` and ``set_rng_state`` so too (``traced_function_transforms.py`` 2.2 - 2.8,
``graph_capture_wrappers.py`` 2.9+). Two compiles that overlap restore each other's patches out of order. Found
by ``python -m torchfix watch`` (torch 2.13: ``torch.cuda.set_rng_state`` held ``create_aot_state.<locals>.<lambda>``
while another thread compiled).

The edit turns each ``patch("torch.cuda.X", fn)`` into ``_torchfix_rng_patches.patched(vars(torch.cuda), "X",
fn)``, a per-thread patch of ``patching/slots.py``: the compiling thread sees torch's stand-in, every other
thread torch's function.
"""

from __future__ import annotations

import ast
import functools
import threading
import types
from collections.abc import Callable

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result, fresh, torch_module
from ..patching.patches import SourcePatch, source_without_import
from ..patching.slots import ThreadPatches, skip_in_dynamo_when_imported
from ..patching.source import Edit, find_replaced, parse, replace_node

AOT = "torch._functorch.aot_autograd"
TRANSFORMS = "torch._functorch._aot_autograd.traced_function_transforms"  # functionalized RNG, 2.2 - 2.8
WRAPPERS = "torch._functorch._aot_autograd.graph_capture_wrappers"  # functionalized RNG, 2.9+
HELPER = "_torchfix_rng_patches"
PATCHED = ("torch.cuda.get_rng_state", "torch.cuda.set_rng_state")


class _RngPatchesPerThread(SourcePatch):
    def __init__(self, module: str, shared: Callable[[], ThreadPatches]) -> None:
        super().__init__(module, module.replace(".", "/") + ".py")
        self._shared = shared  # the fix's modules patch the same two slots: one ThreadPatches, made when applied

    def describe(self) -> str:
        return super().describe() + f"; adds {HELPER}, which keeps its patches of torch.cuda's RNG state per thread"

    def edits(self, source: str) -> list[Edit]:
        edits = []
        for node in find_replaced(
            self.relpath,
            parse(source),
            f"patch() of {' or '.join(PATCHED)}",
            lambda node: (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "patch"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and node.args[0].value in PATCHED
            ),
            count=None,
        ):
            module, name = node.args[0].value.rsplit(".", 1)
            edits += [
                replace_node(node.func, f"{HELPER}.patched"),
                replace_node(node.args[0], f'vars({module}), "{name}"'),
            ]
        return edits

    def helpers(self) -> dict[str, object]:
        return {HELPER: self._shared()}

    def _install_state(self, module: types.ModuleType, source: str) -> None:
        skip_in_dynamo_when_imported()


def _patches(torch_version: str) -> list[SourcePatch]:
    shared = functools.cache(ThreadPatches)  # made at the first apply (it needs torch), not for a diff
    rng_module = TRANSFORMS if torch_version in releases("2.2", "2.8") else WRAPPERS
    modules = [AOT] + ([rng_module] if torch_version in releases("2.2") else [])
    return [_RngPatchesPerThread(module, shared) for module in modules]


def _probe() -> str | None:
    source = source_without_import(AOT) or ""
    if 'patch("torch.cuda.set_rng_state"' not in source:
        return f"{AOT} does not patch torch.cuda.set_rng_state (before torch 2.1)"
    return None


def rng_patch_elsewhere(timeout: float = 60.0) -> Result:
    """Thread A compiles a function (``aot_eager``) whose graph calls a function held at its first call under
    AOTAutograd's patch of ``torch.cuda.set_rng_state``; meanwhile the main thread calls
    ``torch.cuda.set_rng_state("probe")``. torch's function raises on that (no tensor to copy); the compiling thread's
    stand-in returns None."""
    torch = torch_module("torch")
    dynamo = torch_module("torch._dynamo")
    cuda_set = torch.cuda.set_rng_state
    inside, done = threading.Event(), threading.Event()
    errors: list[str] = []

    def held(x):  # in the graph (allow_in_graph): AOTAutograd runs it while it collects metadata
        if torch.cuda.set_rng_state is not cuda_set and not inside.is_set():  # under the patch (or its dispatcher)
            inside.set()
            done.wait(timeout)
        return x * 2

    allowed = dynamo.allow_in_graph(held)

    def step(x):
        return allowed(x).sin()

    def compile_() -> None:
        try:  # a fresh code object: an earlier run of the scenario compiled its own
            torch.compile(fresh(step), backend="aot_eager")(torch.ones(3, requires_grad=True))
        except Exception as exc:
            errors.append(f"the compile raised {type(exc).__name__}: {exc}")
        finally:
            inside.set()

    thread = threading.Thread(target=compile_, name="torchfix-selftest-compile", daemon=True)
    thread.start()
    if not inside.wait(timeout):
        errors.append("the compile never reached AOTAutograd's patch")
    try:
        torch.cuda.set_rng_state("probe")
        seen = "returned None: the compiling thread's stand-in"
    except Exception as exc:
        seen = f"raised {type(exc).__name__}: torch's own"
    done.set()
    thread.join(timeout)
    hazard = seen.startswith("returned") or bool(errors)
    detail = f"torch.cuda.set_rng_state in another thread while one compiles {seen}" + "".join(f"; {e}" for e in errors)
    return Result("AOTAutograd's torch.cuda.set_rng_state patch (another thread compiles)", hazard, detail)


FIX = Fix(
    name="aot-rng-patches",
    order=215,
    hazard="while one thread's AOTAutograd compile collects metadata, torch.cuda.set_rng_state does nothing in every "
    "thread",
    versions=releases("2.1"),
    probe=_probe,
    patches=_patches,
    trigger=AOT,
    scenarios=(
        Scenario(
            rng_patch_elsewhere,
            releases("2.1"),
            shows="returned None: the compiling thread's stand-in",
            # A second run in one process (a fresh compile in a new thread) segfaults there, without torchfix too.
            crashes=releases("2.10", "2.11"),
        ),
    ),
    shared_state=(
        'every AOTAutograd compile collects metadata inside `unittest.mock.patch("torch.cuda.set_rng_state", '
        "lambda *args: None)` (and with functionalized RNG traces inside patches of `get_rng_state` and "
        "`set_rng_state`): `mock.patch` writes the `torch.cuda` module attribute, for the whole process"
    ),
    symptom=(
        "while one thread compiles a training graph, `torch.cuda.set_rng_state(...)` in every other thread silently "
        "does nothing (torch 2.13: every run of its self-test): `torch.utils.checkpoint` restores the CUDA RNG state "
        "that way before it recomputes, so a checkpointed region with dropout recomputes other random numbers than "
        "its forward used, and its gradients are wrong; two compiles that overlap restore each other's patches out of "
        "order. Found by `python -m torchfix watch`"
    ),
    releases_note='before 2.1 no such patch: "not needed"',
    survey_rows=(
        "torch/_functorch/aot_autograd.py, _aot_autograd/graph_capture_wrappers.py: torch.cuda.set_rng_state "
        "/ get_rng_state",
    ),
)
