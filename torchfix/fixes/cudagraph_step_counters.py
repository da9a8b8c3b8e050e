"""cudagraph-step-counters: ``cudagraph_mark_step_begin()`` and the compile generation act per thread (H7).

A CUDA graph tree decides when the outputs of its earlier runs may be overwritten by comparing the
generation it last ran in with the current one: ``MarkStepBox.mark_step_counter`` once the user has called
``torch.compiler.cudagraph_mark_step_begin()``, else ``GenerationTracker.generation``, which every call of a
``torch.compile``d function increments. Both are process globals in every release up to 2.15 (upstream's
2.13 fix made the trees per thread, not these). With threads, one thread's mark-step or compiled call
starts a new generation in every other thread's trees: a tree then frees, or skips the pending-backward
check for, outputs its own thread still needs ("accessing tensor output of CUDAGraphs that has been
overwritten by a subsequent run"; seen on an H200, torch 2.11, 3 threads calling mark-step each step: 1 of
3 threads failed, 2 of 2 runs). ``reset_cudagraph_trees()`` zeroes the counter for all threads too.

Both counters move to a ``Steps`` object per thread, kept in the C++ thread-local stash (until the thread
ends: ``_thread_stash``), as torch keeps the tree containers, so autograd's device thread running a
thread's backward reads that thread's counters.
The trees read them through ``_cudagraph_steps()``. The increment on every compiled call stays call-free
(it must cost next to nothing): it goes to the calling thread's ``Steps`` through a ``threading.local``
whose class default is one shared object, for threads that have not run a CUDA graph (nobody reads it).
"""

from __future__ import annotations

import ast
import importlib
import threading

from .._fix import Fix, Scenario, releases
from .._patch import SourcePatch
from .._selftest import Result, compiled_add_one
from .._source import Edit, ShapeError, parse, replace_node, segment
from .._thread_stash import stash_until_thread_end

TREES = "torch._inductor.cudagraph_trees"
GUARD = "torch._dynamo.mutation_guard"
ACCESSOR = "_cudagraph_steps"  # in cudagraph_trees
THIS_THREAD = "_cudagraph_thread_steps"  # in mutation_guard, the per-call increment's target
KEY = "torchfix_cudagraph_steps"  # of the C++ thread-local stash


class Steps:
    """One thread's CUDA-graph generation counters."""

    __slots__ = ("mark_step_counter", "generation")

    def __init__(self) -> None:
        self.mark_step_counter = 0  # decremented by cudagraph_mark_step_begin(), as MarkStepBox's
        self.generation = 0  # incremented on every call of a compiled function, as GenerationTracker's


UNCOUNTED = Steps()  # every thread's until its first CUDA graph: increments no tree reads


class ThreadSteps(threading.local):
    steps = UNCOUNTED  # a class default, so the increment needs no call in any thread


def steps_of_this_work() -> Steps:
    """The counters of the thread whose work runs now: the calling thread's, or on autograd's device
    thread those of the thread whose backward it runs (the C++ stash is inherited from that thread)."""
    import torch
    from torch._inductor import cudagraph_trees

    if torch._C._is_key_in_tls(KEY):
        return torch._C._get_obj_in_tls(KEY)
    if torch._C._is_key_in_tls("tree_manager_containers") and not hasattr(
        cudagraph_trees.local, "tree_manager_containers"
    ):
        return UNCOUNTED  # a device thread, for a thread whose trees predate torchfix: nothing to share
    steps = Steps()
    stash_until_thread_end(KEY, steps)
    vars(importlib.import_module(GUARD))[THIS_THREAD].steps = steps
    return steps


class _TreeCounters(SourcePatch):
    """The trees read and write the per-thread counters instead of the globals."""

    def __init__(self) -> None:
        super().__init__(TREES, "torch/_inductor/cudagraph_trees.py")

    def describe(self) -> str:
        return super().describe() + f"; adds {ACCESSOR}, the counters of the thread whose work runs"

    def edits(self, source: str) -> list[Edit]:
        tree = parse(source)
        marks = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and segment(source, node) == "MarkStepBox.mark_step_counter"
        ]
        generations = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and segment(source, node) == "GenerationTracker.generation"
        ]
        if not marks or len(generations) != 1:
            raise ShapeError(f"{self.relpath}: expected uses of MarkStepBox and one read of GenerationTracker")
        return [replace_node(node, f"{ACCESSOR}().mark_step_counter") for node in marks] + [
            replace_node(generations[0], f"{ACCESSOR}().generation")
        ]

    def helpers(self) -> dict[str, object]:
        return {ACCESSOR: steps_of_this_work}


class _CountPerThread(SourcePatch):
    """The one increment of ``GenerationTracker.generation`` in a Dynamo file also counts for the thread."""

    def __init__(self, module: str, relpath: str) -> None:
        super().__init__(module, relpath)
        self.holder = THIS_THREAD if module == GUARD else f"{GUARD}.{THIS_THREAD}"

    def edits(self, source: str) -> list[Edit]:
        bumps = [
            node
            for node in ast.walk(parse(source))
            if isinstance(node, ast.AugAssign)
            and isinstance(node.op, ast.Add)
            and segment(source, node.target).endswith("GenerationTracker.generation")
        ]
        if len(bumps) != 1:
            raise ShapeError(f"{self.relpath}: expected one increment of GenerationTracker.generation")
        bump = bumps[0]
        return [replace_node(bump, f"{segment(source, bump)}; {self.holder}.steps.generation += 1")]

    def helpers(self) -> dict[str, object]:
        return {THIS_THREAD: ThreadSteps()} if self.module_name == GUARD else {}


def _probe() -> str | None:
    module = importlib.import_module(TREES)
    if ACCESSOR in vars(module):
        return "the CUDA-graph step counters are per thread already"
    if not isinstance(getattr(getattr(module, "MarkStepBox", None), "mark_step_counter", None), int):
        return f"{TREES} has no MarkStepBox.mark_step_counter"
    return None


def h7_cudagraph_step_counters(timeout: float = 60.0) -> Result | None:
    """One thread calls ``torch.compiler.cudagraph_mark_step_begin()`` and a compiled function; the
    generation another thread's CUDA graph trees read must not move (every release up to 2.15). No GPU."""
    import torch

    try:
        from torch._inductor import cudagraph_trees
    except ImportError:
        return None
    compiled = compiled_add_one()
    manager = cudagraph_trees.CUDAGraphTreeManager
    first_read, acted, seen = threading.Event(), threading.Event(), []

    def read() -> tuple[int, bool]:
        return manager.get_curr_generation(), manager.user_invoked_mark_step()

    def other() -> None:  # a thread with counters of its own (it ran a compiled call), read twice
        compiled(torch.ones(2))
        seen.append(read())
        first_read.set()
        acted.wait(timeout)
        seen.append(read())

    thread = threading.Thread(target=other, name="torchfix-selftest")
    thread.start()
    first_read.wait(timeout)
    torch.compiler.cudagraph_mark_step_begin()
    compiled(torch.ones(2))
    mine = read()
    acted.set()
    thread.join(timeout)
    before, after = (seen + [None, None])[:2]
    moved = before != after
    detail = f"another thread's (generation, mark-step) went {before} -> {after}; the acting thread's: {mine}"
    return Result("H7 (mark-step and compiled call in one thread, CUDA graph generation in another)", moved, detail)


FIX = Fix(
    name="cudagraph-step-counters",
    order=190,
    hazard="with mode='reduce-overhead', one thread's cudagraph_mark_step_begin() or compiled call starts a "
    "new generation in every thread's CUDA graph trees, which then overwrite outputs their thread still needs",
    versions=releases("2.1"),
    probe=_probe,
    # The per-thread holder first: the increments written into Dynamo's files refer to it.
    patches=lambda _torch_version: [
        _CountPerThread(GUARD, "torch/_dynamo/mutation_guard.py"),
        _CountPerThread("torch._dynamo.eval_frame", "torch/_dynamo/eval_frame.py"),
        _TreeCounters(),
    ],
    trigger=TREES,
    scenarios=(Scenario(h7_cudagraph_step_counters, releases("2.1"), needs="CUDA graph trees (2.1+)"),),
    shared_state=(
        "H7: `MarkStepBox.mark_step_counter` and `GenerationTracker.generation`, which the trees read to decide "
        "when earlier outputs may be overwritten, are process globals"
    ),
    symptom=(
        "one thread's `cudagraph_mark_step_begin()` (or compiled call) starts a new generation in every thread's "
        "trees, which overwrite outputs their own thread still needs"
    ),
)
