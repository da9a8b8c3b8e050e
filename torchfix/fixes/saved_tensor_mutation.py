"""saved-tensor-mutation: ``torch.autograd.graph.allow_mutation_on_saved_tensors()`` in several threads at once.

The context lets a thread mutate tensors saved for backward (it clones them first, through a saved-tensors hook
and a dispatch mode, both per thread in C++). Whether a context is active is one module global,
``torch.autograd.graph._allow_mutation_on_saved_tensors_enabled`` (every release, 2.0 - 2.15), which the
context sets on entry and clears in its ``finally``, which refuses a second context while it is set ("cannot be
nested"), and which the unpack hook checks when backward reads a saved tensor ("Trying to backward outside of
the 'allow_mutation_on_saved_tensors' context"). So while thread A is inside a context, thread B's context
raises "cannot be nested", and that failed entry's ``finally`` clears the flag: A's backward then raises
(reproduced on 2.13 and 2.14.1).

The flag cannot simply be per thread: backward runs the unpack hook on autograd's device thread for CUDA
tensors (and on whatever thread calls backward), not in the thread inside the context. So it splits in two:

* the nesting check and the module name are per thread (:class:`ThreadLocalGlobals`,
  ``graph._saved_tensor_mutation_tls``): a thread still cannot nest contexts, and
  ``graph._allow_mutation_on_saved_tensors_enabled`` read from elsewhere says whether the calling thread is inside
  one;
* the unpack hook checks the context its graph was recorded in, which its closure holds: the context sets
  ``ctx.active`` beside the thread's flag on entry and clears it on exit.

One difference from torch in a single thread: after a nested entry failed (and was caught) inside a context, the
outer context's graphs still run backward; torch's failed entry clears the process flag, so they raise.
"""

from __future__ import annotations

import ast
import threading

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result
from ..patching.patches import ThreadLocalGlobals, moved_global_probe
from ..patching.source import Edit, ShapeError, definitions, nested_function

MODULE = "torch.autograd.graph"
RELPATH = "torch/autograd/graph.py"
FLAG, HOLDER, ATTR = "_allow_mutation_on_saved_tensors_enabled", "_saved_tensor_mutation_tls", "enabled"
CONTEXT, HOOKS = "allow_mutation_on_saved_tensors", "_swap_with_cloned.__init__"


def _names(node: ast.AST, name: str) -> list[ast.Name]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Name) and n.id == name]


class _PerContextActive(ThreadLocalGlobals):
    """The flag per thread, and the unpack hook reading its own context's ``active`` instead."""

    def __init__(self) -> None:
        super().__init__(MODULE, RELPATH, HOLDER, {FLAG: ATTR}, seen_in_backward=True)

    def describe(self) -> str:
        return (
            super().describe() + f"; {CONTEXT}() sets ctx.active beside it, and the unpack hook of "
            f"{HOOKS.split('.')[0]} checks ctx.active (backward can run on another thread)"
        )

    def edits(self, source: str) -> list[Edit]:
        found = definitions(source)
        context, hooks = found.get(CONTEXT), found.get(HOOKS)
        if context is None or hooks is None or "ctx" not in [a.arg for a in hooks.args.args]:
            raise ShapeError(f"{self.relpath}: no {CONTEXT}, or no {HOOKS}(self, ctx)")
        assigned = [node for node in ast.walk(context) if isinstance(node, ast.Assign) and len(node.targets) == 1]
        if not any(isinstance(node.targets[0], ast.Name) and node.targets[0].id == "ctx" for node in assigned):
            raise ShapeError(f"{self.relpath}: {CONTEXT} has no local ctx")
        # The context's two stores of the flag (True on entry, False in its finally), and the unpack hook's read.
        stores = {
            (node.targets[0].lineno, node.targets[0].col_offset): node.value.value
            for node in assigned
            if isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == FLAG
            and isinstance(node.value, ast.Constant)
        }
        reads = _names(nested_function(self.relpath, hooks, ["unpack_hook"]), FLAG)
        if sorted(stores.values()) != [False, True] or len(reads) != 1:
            raise ShapeError(
                f"{self.relpath}: expected one read of {FLAG} in unpack_hook, a True and a False in {CONTEXT}"
            )
        read = (reads[0].lineno, reads[0].col_offset)
        edits = []
        for edit in super().edits(source):
            if (edit.line, edit.start_col) == read:
                edit = Edit(edit.line, edit.start_col, edit.end_col, 'getattr(ctx, "active", False)')
            elif (edit.line, edit.start_col) in stores:
                edit = Edit(edit.line, edit.start_col, edit.end_col, f"{edit.text} = ctx.active")
            edits.append(edit)
        return edits


def _record(results: dict[str, str], name: str):
    """A graph recorded in the calling thread: ``x`` saved by ``sin``, then mutated in place (what the context
    allows); returns what runs its backward and checks the gradient (cos of the value ``sin`` saw)."""
    import torch

    leaf = torch.ones(3, requires_grad=True)
    x = leaf.clone()
    y = x.sin().sum()
    x.add_(1.0)

    def backward() -> None:
        try:
            y.backward()
            right = torch.allclose(leaf.grad, torch.ones(3).cos())
            results[name] = "ran" if right else f"ran, gradient {leaf.grad.tolist()}"
        except Exception as exc:
            results[name] = f"raised {type(exc).__name__}: {str(exc).splitlines()[0]}"

    return backward


def saved_tensor_mutation_elsewhere(timeout: float = 60.0) -> Result:
    """Thread A enters ``allow_mutation_on_saved_tensors()`` and records two graphs that mutate saved tensors. While
    A is inside, the main thread runs one of its own in its own context; another thread runs backward of one of A's
    graphs (as autograd's device thread does for CUDA); then A runs backward of the other. All three must run, with
    the gradients of the values saved."""
    import torch

    amost = torch.autograd.graph.allow_mutation_on_saved_tensors
    inside, go, results = threading.Event(), threading.Event(), {}

    def held() -> None:
        try:
            with amost():
                own, elsewhere = _record(results, "A's own backward"), _record(results, "another thread's backward")
                results["elsewhere"] = elsewhere
                inside.set()
                go.wait(timeout)
                own()
        except Exception as exc:
            results["A's own backward"] = f"raised {type(exc).__name__}: {str(exc).splitlines()[0]}"
        finally:
            inside.set()

    thread = threading.Thread(target=held, name="torchfix-selftest")
    thread.start()
    inside.wait(timeout)
    try:
        with amost():
            _record(results, "the main thread's context")()
    except Exception as exc:
        results["the main thread's context"] = f"raised {type(exc).__name__}: {str(exc).splitlines()[0]}"
    elsewhere = results.pop("elsewhere", None)
    if elsewhere is not None:
        other = threading.Thread(target=elsewhere, name="torchfix-selftest-backward")
        other.start()
        other.join(timeout)
    go.set()
    thread.join(timeout)
    names = ("the main thread's context", "another thread's backward", "A's own backward")
    outcomes = {name: results.get(name, "no answer") for name in names}
    return Result(
        "allow_mutation_on_saved_tensors (a context in each of two threads, backward in a third)",
        any(outcome != "ran" for outcome in outcomes.values()),
        "; ".join(f"{name}: {outcome}" for name, outcome in outcomes.items()),
    )


FIX = Fix(
    name="saved-tensor-mutation",
    order=310,
    hazard="torch.autograd.graph.allow_mutation_on_saved_tensors() in two threads at once: the second raises "
    "'contexts cannot be nested', and the first's backward then raises 'Trying to backward outside of the "
    "allow_mutation_on_saved_tensors context'",
    versions=releases("2.0"),
    probe=moved_global_probe(MODULE, HOLDER, FLAG, f"{MODULE} has no {FLAG}"),
    patches=lambda _torch_version: [_PerContextActive()],
    scenarios=(
        Scenario(
            saved_tensor_mutation_elsewhere,
            releases("2.0"),
            shows="cannot be nested",
        ),
    ),
    shared_state=(
        "`torch.autograd.graph.allow_mutation_on_saved_tensors()` keeps whether a context is active in one "
        "process global, `_allow_mutation_on_saved_tensors_enabled`, which refuses a second context and which the"
        " unpack hook checks during backward"
    ),
    symptom=(
        "while one thread is inside the context, another thread's context raises `allow_mutation_on_saved_tensors"
        " contexts cannot be nested`, and that failed entry clears the flag: the first thread's backward then "
        "raises `Trying to backward outside of the 'allow_mutation_on_saved_tensors' context` (torch 2.13, "
        "2.14.1); now the nesting check is per thread and the unpack hook asks its own context (backward may run "
        "on autograd's device thread)"
    ),
    caveats=(
        "`saved-tensor-mutation` cannot simply make torch's flag per thread: backward runs the unpack hook that "
        "checks it on autograd's device thread for CUDA tensors (or on whichever thread calls backward). The "
        "nesting check is per thread, and the hook asks the context its graph was recorded in (`ctx.active`, "
        "which the context sets beside the thread's flag). One change in a single thread: after a nested entry "
        "failed (and was caught) inside a context, the outer context's graphs still run backward, where torch's "
        "failed entry cleared the process flag under them."
    ),
    survey_rows=("torch/autograd/graph.py: _allow_mutation_on_saved_tensors_enabled",),
)
