"""autograd-entry-patches: ``torch.compiler._patch_engine_backward()`` / ``_patch_autograd_grad()`` act only in
the thread that enters them.

Non-strict tracers (torchtitan's, under ``torch.compiler._non_strict_tracing_context()``) enter these context
managers so that backward nodes traced by ``make_fx`` keep their stack traces and sequence numbers: for the
context's duration ``_patch_engine_backward()`` (torch 2.13+) writes a wrapper over
``torch.autograd.graph._engine_run_backward`` and ``torch.autograd._engine_run_backward`` (what
``Tensor.backward()`` and ``torch.autograd.grad`` call), and ``_patch_autograd_grad()`` (2.12+, deprecated from
2.13) one over ``torch.autograd.grad``: process-wide, by module attribute. Every other thread's ordinary
``loss.backward()`` (or ``torch.autograd.grad``) then runs the wrapper. Without torchfix the wrapper's check
passes there (``_is_non_strict_tracing()`` reads one process global) and the other thread's backward silently
gets the tracer's hooks; with compiler-flags, which makes that flag per-thread, the other thread's backward raises
``AssertionError: _patch_engine_backward() must be used under _non_strict_tracing_context()`` (both reproduced
on torch 2.13). Two threads inside the contexts at once can also restore each other's wrapper out of order and
leave it in place for good. Nothing in torch itself enters them; still so in 2.15.

The writes go through ``torch.compiler._thread_patches``, a ``ThreadPatches`` (``patching/slots.py``, the
per-thread dispatcher of trace-patch-isolation): the patched names hold a dispatcher while any thread is inside a
context, which calls the calling thread's wrapper, or torch's own function in every other thread. The read of
the function to wrap becomes the calling thread's view (``ThreadPatches.current``), never another thread's wrapper
or the dispatcher, and the restore in ``finally`` undoes the calling thread's own write. Not covered: a backward
that the patching thread starts but autograd runs elsewhere (a reentrant backward on a device thread) runs
torch's function there, without the hooks (debug metadata only); and Dynamo, compiling a call of
``torch.autograd.grad`` while another thread is inside ``_patch_autograd_grad()``, inlines torch's function
(the dispatcher's ``_torchdynamo_inline``) rather than treating it as the in-graph function it knows.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import threading
import types
import warnings

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result
from ..patching.patches import SourcePatch
from ..patching.slots import ThreadPatches, in_finally, skip_in_dynamo_when_imported
from ..patching.source import Edit, ShapeError, definitions, replace_node, segment

MODULE = "torch.compiler"
HELPER = "_thread_patches"
# The context managers, and the slots each patches: the attribute as torch's source spells it -> (module, name).
CONTEXTS = {
    "_patch_autograd_grad": ("torch.autograd.grad",),  # 2.12+
    "_patch_engine_backward": ("torch.autograd.graph._engine_run_backward", "torch.autograd._engine_run_backward"),
}


def _slot(attribute: str) -> str:
    """``torch.autograd.grad`` -> ``vars(torch.autograd), "grad"``: the slot as ThreadPatches takes it."""
    owner, _, name = attribute.rpartition(".")
    return f'vars({owner}), "{name}"'


class _PerThreadPatches(SourcePatch):
    def __init__(self) -> None:
        super().__init__(MODULE, "torch/compiler/__init__.py")

    def describe(self) -> str:
        return super().describe() + f"; adds {HELPER}, which keeps the contexts' patches per thread"

    def edits(self, source: str) -> list[Edit]:
        functions = definitions(source)
        present = {name: slots for name, slots in CONTEXTS.items() if name in functions}
        if "_patch_autograd_grad" not in present:
            raise ShapeError(f"{self.relpath}: no _patch_autograd_grad (torch 2.12 - 2.15 have it)")
        edits = []
        for name, slots in present.items():
            edits += self._context_edits(source, functions[name], slots)
        return edits

    def _context_edits(self, source: str, function: ast.FunctionDef, slots: tuple[str, ...]) -> list[Edit]:
        """In one context manager: the read of the function it wraps (the first slot), each slot's write, and
        each slot's restore in ``finally``; exactly those, or the shape is not the one this fix knows."""
        restores, edits = in_finally(function), []
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

    def helpers(self) -> dict[str, object]:
        return {HELPER: ThreadPatches()}

    def _install_state(self, module: types.ModuleType, source: str) -> None:
        skip_in_dynamo_when_imported()  # the dispatchers, where Dynamo meets them


def _probe() -> str | None:
    if importlib.util.find_spec(MODULE) is None:
        return f"torch has no {MODULE} (before 2.1): no context managers to share"
    module = importlib.import_module(MODULE)
    if HELPER in vars(module):
        return "the autograd entry patches are per-thread already"
    if not hasattr(module, "_patch_autograd_grad"):
        return f"{MODULE} has no _patch_autograd_grad or _patch_engine_backward (before torch 2.12)"
    return None


class _Backward:
    """An ordinary backward for ``context`` (``loss.backward()``; ``torch.autograd.grad`` for
    ``_patch_autograd_grad``), and who went through a context's wrapper: a spy on the function the wrappers call
    (which they import by name when the context is entered), put in place by ``with``."""

    def __init__(self, torch: object, context: str) -> None:
        from torch._functorch._aot_autograd import logging_utils

        self.torch, self.context, self.module = torch, context, logging_utils
        self.hooks = logging_utils.setup_stacktrace_preservation_hooks_from_tensors
        self.wrapped_in: list[int] = []  # the threads that called it
        self.what = "torch.autograd.grad" if context == "_patch_autograd_grad" else "backward()"
        self.slots = [attribute.rpartition(".") for attribute in CONTEXTS[context]]
        self.originals = self.current()

    def current(self) -> list[object]:
        return [getattr(importlib.import_module(owner), name) for owner, _, name in self.slots]

    def left_patched(self) -> list[str]:
        now = self.current()
        return [owner + "." + name for (owner, _, name), a, b in zip(self.slots, now, self.originals) if a is not b]

    def put_back(self) -> None:
        """Put torch's functions back where a wrapper was left behind (for the scenarios after this one)."""
        for (owner, _, name), original in zip(self.slots, self.originals):
            setattr(importlib.import_module(owner), name, original)

    def __enter__(self) -> _Backward:
        def spy(outputs):
            self.wrapped_in.append(threading.get_ident())
            return self.hooks(outputs)

        self.module.setup_stacktrace_preservation_hooks_from_tensors = spy
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.module.setup_stacktrace_preservation_hooks_from_tensors = self.hooks

    def run(self, wrapper: str) -> str:
        """Run the backward in the calling thread: what it went through (``wrapper`` names a wrapper's owner)."""
        torch, me, before = self.torch, threading.get_ident(), len(self.wrapped_in)
        try:
            w = torch.ones(3, requires_grad=True)
            loss = (w * 2).sum()
            if self.context == "_patch_autograd_grad":
                grad = torch.autograd.grad(loss, w)[0].tolist()
            else:
                loss.backward()
                grad = w.grad.tolist()
        except Exception as exc:
            text = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
            if "must be used under _non_strict_tracing_context" in text:
                return f"went through {wrapper}, which raised {text}"
            return f"raised {text}"
        ran = me in self.wrapped_in[before:]
        return f"went through {wrapper} (grad {grad})" if ran else f"ran torch's own (grad {grad})"


class _InContext:
    """A thread inside ``_non_strict_tracing_context()`` and the context (its non-strict trace), until released;
    then it runs the backward there. :meth:`end` releases it and says what that backward went through."""

    def __init__(self, backward: _Backward, timeout: float) -> None:
        self.backward, self.timeout = backward, timeout
        self.inside, self.release, self.answers = threading.Event(), threading.Event(), []
        self.thread = threading.Thread(target=self._run, name="torchfix-selftest", daemon=True)
        self.thread.start()
        self.inside.wait(timeout)

    def _run(self) -> None:
        torch = self.backward.torch
        try:
            with contextlib.ExitStack() as contexts:
                with warnings.catch_warnings():  # 2.13+: "_patch_autograd_grad() is deprecated", in the doctor's output
                    warnings.filterwarnings("ignore", "torch.compiler._patch_autograd_grad")
                    contexts.enter_context(torch.compiler._non_strict_tracing_context())
                    contexts.enter_context(getattr(torch.compiler, self.backward.context)())
                self.inside.set()
                self.release.wait(self.timeout)
                self.answers.append(self.backward.run("its wrapper"))
        except Exception as exc:
            self.answers.append(f"raised {exc!r}")
        finally:
            self.inside.set()

    def end(self) -> str:
        self.release.set()
        self.thread.join(self.timeout)
        return (self.answers or ["no answer"])[0]


def autograd_entry_patched_elsewhere(context: str, timeout: float = 60.0) -> Result | None:
    """Thread A is inside ``torch.compiler._non_strict_tracing_context()`` and ``context`` (``_patch_engine_backward``
    or ``_patch_autograd_grad``) while the main thread runs an ordinary backward (``loss.backward()``, or
    ``torch.autograd.grad`` for ``_patch_autograd_grad``): that must neither run A's wrapper nor fail. Then A runs
    the same inside its context: that must run its wrapper. Afterwards torch's functions are back in place. None
    where torch has no such context manager."""
    import torch

    if not hasattr(getattr(torch, "compiler", None), context):  # no torch.compiler before 2.1
        return None
    with _Backward(torch, context) as backward:
        held = _InContext(backward, timeout)
        try:
            mine = backward.run("the other thread's wrapper")
        finally:
            theirs = held.end()
    left, what = backward.left_patched(), backward.what
    detail = f"the main thread's {what} {mine}; the {what} inside {context}() {theirs}"
    detail += f"; left patched: {', '.join(left)}" if left else ""
    hazard = not mine.startswith("ran torch's own") or not theirs.startswith("went through its wrapper") or bool(left)
    return Result(f"autograd entry patches ({context}() in one thread, {what} in another)", hazard, detail)


def autograd_entry_patches_overlap(context: str, timeout: float = 60.0) -> Result | None:
    """Threads A and B enter ``context`` in that order (each in its own non-strict trace) and leave it in the same
    order, overlapping; each runs its backward inside, through its own wrapper. Afterwards torch's functions must be
    back in place, and a backward in the main thread must run torch's own. None where torch has no such context
    manager. Without the fix B restores A's wrapper, which stays for the process."""
    import torch

    if not hasattr(getattr(torch, "compiler", None), context):  # no torch.compiler before 2.1
        return None
    with _Backward(torch, context) as backward:
        first = _InContext(backward, timeout)
        second = _InContext(backward, timeout)
        theirs = [first.end(), second.end()]
        left = backward.left_patched()
        mine = backward.run("a wrapper left behind")
        if left:
            backward.put_back()
    what = backward.what
    detail = f"afterwards the main thread's {what} {mine}; inside the contexts: {theirs[0]}; {theirs[1]}"
    detail += f"; left patched: {', '.join(left)}" if left else ""
    hazard = not mine.startswith("ran torch's own") or bool(left)
    hazard |= not all(answer.startswith("went through its wrapper") for answer in theirs)
    return Result(f"autograd entry patches (two threads' {context}() overlapping)", hazard, detail)


FIX = Fix(
    name="autograd-entry-patches",
    order=200,
    hazard="while one thread is inside torch.compiler._patch_engine_backward() (or _patch_autograd_grad()), every "
    "thread's backward runs its wrapper, which raises AssertionError outside a non-strict trace",
    versions=releases("2.12"),
    probe=_probe,
    patches=lambda _torch_version: [_PerThreadPatches()],
    scenarios=(
        Scenario(
            autograd_entry_patched_elsewhere,
            releases("2.13"),
            args=("_patch_engine_backward",),
            needs="torch.compiler._patch_engine_backward (2.13+)",
            shows="went through the other thread's wrapper",
        ),
        Scenario(
            autograd_entry_patched_elsewhere,
            releases("2.12"),
            args=("_patch_autograd_grad",),
            needs="torch.compiler._patch_autograd_grad (2.12+)",
            shows="went through the other thread's wrapper",
        ),
        Scenario(
            autograd_entry_patches_overlap,
            releases("2.13"),
            args=("_patch_engine_backward",),
            needs="torch.compiler._patch_engine_backward (2.13+)",
            shows="left patched: torch.autograd.graph._engine_run_backward",
            stage=1,
        ),
    ),
    shared_state=(
        "`torch.compiler._patch_engine_backward()` and `_patch_autograd_grad()`, which non-strict tracers "
        "(torchtitan) enter, replace `torch.autograd._engine_run_backward` (what `backward()` calls, both names) "
        "and `torch.autograd.grad` for the whole process while they last"
    ),
    symptom=(
        "while one thread traces inside them, every other thread's `loss.backward()` runs its wrapper: silently "
        "without torchfix, and with `compiler-flags` (the non-strict flag per thread) it raises `AssertionError: "
        "_patch_engine_backward() must be used under _non_strict_tracing_context()`; two threads inside them at "
        "once leave the wrapper in place for good. The patches now act in the thread that makes them "
        "(`trace-patch-isolation`'s per-thread dispatcher)"
    ),
    releases_note='`_patch_engine_backward` from 2.13; before 2.12: "not needed"',
    caveats=(
        "A backward that the patching thread starts but autograd runs on another thread (a reentrant backward on "
        "a device thread) runs torch's own function there, without the wrapper's stack-trace hooks (debug "
        "metadata only)."
    ),
    survey_rows=("torch/compiler/__init__.py: torch.autograd.grad / torch.autograd(.graph)._engine_run_backward",),
)
