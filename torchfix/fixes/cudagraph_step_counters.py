"""cudagraph-step-counters: ``cudagraph_mark_step_begin()`` and the compile generation act per thread (H7).

A CUDA graph tree decides when the outputs of its earlier runs may be overwritten by comparing the
generation it last ran in with the current one: ``MarkStepBox.mark_step_counter`` once the user has called
``torch.compiler.cudagraph_mark_step_begin()``, else ``GenerationTracker.generation``, which every call of a
``torch.compile``d function increments. Both are process globals in every release up to 2.15 (upstream's
2.13 fix made the trees per thread, not these). With threads, one thread's mark-step or compiled call
starts a new generation in every other thread's trees: a tree then frees, or skips the pending-backward
check for, outputs its own thread still needs ("accessing tensor output of CUDAGraphs that has been
overwritten by a subsequent run"; seen on an H200, torch 2.11, 3 threads calling mark-step each step: 1 of
3 threads failed, 2 of 2 runs). ``reset_cudagraph_trees()`` and ``torch._dynamo.reset()`` zero the counters
for all threads too.

The class attributes stay the process's counters, which torch's own code goes on changing as before and
which code outside the trees reads and writes (torch's tests write ``GenerationTracker.generation -= 1`` to
stay in one generation). Each statement of torch's that changes one also changes it in two ``Steps``: the
calling thread's own (kept in the C++ thread-local stash until the thread ends, ``patching.stash``, as torch
keeps the tree containers, so that autograd's device thread running a thread's backward reads that thread's
counters) and ``BY_TORCH``, the sum of all of torch's changes. A tree reads its thread's own counter plus
what else changed the class attribute (the attribute less ``BY_TORCH``): in one thread that is the class
attribute itself, whatever wrote it; across threads, each thread's own steps, and a direct write reaches every
thread, as it does without torchfix. torch's resets zero the calling thread's counter, not the others'.
The increment on every compiled call stays call-free (it must cost next to nothing): it goes to the calling
thread's ``Steps`` through a ``threading.local`` whose class default is one shared object, for threads that
have not run a CUDA graph (nobody reads it). The trees' reads in the thread that owns them are call-free too (the
same ``threading.local``); only autograd's device thread reads the stash.
"""

from __future__ import annotations

import ast
import importlib
import sys
import threading

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result, compiled_add_one
from ..patching.patches import PerThreadName, SourcePatch, per_thread_class
from ..patching.source import Edit, ShapeError, parse, replace_node, segment
from ..patching.stash import stash_until_thread_end

TREES = "torch._inductor.cudagraph_trees"
GUARD = "torch._dynamo.mutation_guard"
ACCESSOR = "_cudagraph_steps"  # in cudagraph_trees: the Steps of the thread whose work runs
READS = {  # in cudagraph_trees: what the trees read instead of the class attributes
    "MarkStepBox.mark_step_counter": "_cudagraph_mark_step_counter",
    "GenerationTracker.generation": "_cudagraph_generation",
}
THIS_THREAD = "_cudagraph_thread_steps"  # in mutation_guard, the per-call increment's target
TORCH_TOTAL = "_cudagraph_steps_by_torch"  # in both modules: BY_TORCH
KEY = "torchfix_cudagraph_steps"  # of the C++ thread-local stash
# Where ``x.attr += 1`` from several threads can lose an update (Python before 3.10 switches threads between
# the read and the write; a build without the GIL has no switch at all), the class attribute less BY_TORCH
# would drift without any write of the user's, and move every thread's generation: there the trees read their
# own steps only, and a direct write of the class attributes does not reach them (measured: 4 threads x 300 k
# increments lost 30 - 40 % on 3.8 and 3.9, none on 3.10 - 3.13).
COUNTS_ARE_EXACT = sys.version_info >= (3, 10) and getattr(sys, "_is_gil_enabled", lambda: True)()


class Steps:
    """CUDA-graph step counters as torch's own code changed them: one thread's, or every thread's (BY_TORCH)."""

    __slots__ = ("mark_step_counter", "generation")

    def __init__(self, generation: int = 0) -> None:
        self.mark_step_counter = 0  # decremented by cudagraph_mark_step_begin(), as MarkStepBox's
        self.generation = generation  # incremented on every call of a compiled function, as GenerationTracker's


# Both outlive an uninstall: a thread's Steps stay in its stash, and a later install must count on from them.
BY_TORCH = Steps()
UNCOUNTED = Steps()  # every thread's until its first CUDA graph: increments no tree reads


# Class defaults, so that neither the increment nor a read needs a call in any thread. ``steps`` is what torch's
# per-call increment writes to; ``own`` is set only in a thread that made its Steps for its own work, where it is
# the Steps of its stash too, and lets the trees' reads there skip the C stash (they read several times a replay).
# Autograd's device thread reaches a thread's Steps through the stash (_steps_from_stash), not through these.
THREAD_STEPS = per_thread_class("ThreadSteps", {"steps": UNCOUNTED, "own": None}, {}, seen_in_backward=False)()


def steps_of_this_work() -> Steps:
    """The counters of the thread whose work runs now: the calling thread's, or on autograd's device thread those
    of the thread whose backward it runs."""
    return THREAD_STEPS.own or _steps_from_stash()


def _steps_from_stash() -> Steps:
    """``steps_of_this_work()`` through the C++ stash, which autograd's device thread inherits from the thread whose
    backward it runs: one C call (a thread's first pays for a C++ exception instead), modules from ``sys.modules``
    (both are imported by then), no import."""
    c = sys.modules["torch"]._C
    try:
        return c._get_obj_in_tls(KEY)
    except RuntimeError:  # not in this thread's stash yet
        pass
    if c._is_key_in_tls("tree_manager_containers") and not hasattr(sys.modules[TREES].local, "tree_manager_containers"):
        return UNCOUNTED  # a device thread, for a thread whose trees predate torchfix: nothing to share
    # A thread's trees start at the process's generation, as without torchfix, and move with its own calls;
    # it has made no mark-step yet (it counts them from its first, which comes here).
    steps = Steps(generation=BY_TORCH.generation)
    stash_until_thread_end(KEY, steps)
    THREAD_STEPS.steps = steps
    # Outside a backward the stash is the thread's own: autograd's device thread runs Python only inside a backward
    # (of another thread's). A thread whose first read comes in its own backward reads through the stash, as before
    # (and every thread, on a torch without the graph task's id).
    graph_task = getattr(c, "_current_graph_task_id", None)
    if graph_task is not None and graph_task() == -1:
        THREAD_STEPS.own = steps
    return steps


# The two readers below add what code other than torch's own changed the class attribute by (the attribute less
# BY_TORCH's count), written out in each, with steps_of_this_work() inlined: the trees read them several times per
# replay.


def mark_step_counter_of_this_work() -> int:
    """``MarkStepBox.mark_step_counter`` as the trees of the thread whose work runs now see it."""
    own = (THREAD_STEPS.own or _steps_from_stash()).mark_step_counter
    if not COUNTS_ARE_EXACT:
        return own
    return own + sys.modules[TREES].MarkStepBox.mark_step_counter - BY_TORCH.mark_step_counter


def generation_of_this_work() -> int:
    """``GenerationTracker.generation`` as the trees of the thread whose work runs now see it."""
    own = (THREAD_STEPS.own or _steps_from_stash()).generation
    if not COUNTS_ARE_EXACT:
        return own
    return own + sys.modules[GUARD].GenerationTracker.generation - BY_TORCH.generation


def _target(write: ast.AugAssign | ast.Assign) -> ast.expr:
    return write.targets[0] if isinstance(write, ast.Assign) else write.target


def _change(source: str, write: ast.AugAssign | ast.Assign) -> str:
    """What a statement does to its target: " -= 1", " = 0"."""
    return segment(source, write)[len(segment(source, _target(write))) :]


def _also_counted(source: str, write: ast.AugAssign | ast.Assign, *counters: str) -> Edit:
    """torch's statement that changes a counter, followed by the same change of each of ``counters``."""
    change = _change(source, write)
    return replace_node(write, "; ".join([segment(source, write), *(counter + change for counter in counters)]))


def _writes(tree: ast.AST, attr: str) -> list[ast.AugAssign | ast.Assign]:
    """The one-target statements that write ``<something>.attr``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign):
            targets = [node.target]
        else:
            continue
        if len(targets) == 1 and isinstance(targets[0], ast.Attribute) and targets[0].attr == attr:
            found.append(node)
    return found


class _TreeCounters(SourcePatch):
    """The trees read their thread's counters; torch's changes of ``MarkStepBox.mark_step_counter`` count for the
    thread and in BY_TORCH too."""

    def __init__(self) -> None:
        super().__init__(TREES, "torch/_inductor/cudagraph_trees.py")

    def describe(self) -> str:
        return super().describe() + f"; adds {ACCESSOR}, {', '.join(READS.values())} and {TORCH_TOTAL}"

    def edits(self, source: str) -> list[Edit]:
        tree = parse(source)
        writes = [w for w in _writes(tree, "mark_step_counter") if segment(source, w).startswith("MarkStepBox.")]
        written = {id(_target(w)) for w in writes}
        reads = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and segment(source, node) in READS and id(node) not in written
        ]
        read_names = [segment(source, node) for node in reads]
        if not writes or read_names.count("GenerationTracker.generation") != 1 or len(reads) < 2:
            raise ShapeError(
                f"{self.relpath}: expected writes and reads of MarkStepBox and one read of GenerationTracker"
            )
        counters = (f"{TORCH_TOTAL}.mark_step_counter", f"{ACCESSOR}().mark_step_counter")
        return [_also_counted(source, w, *counters) for w in writes] + [
            replace_node(node, f"{READS[name]}()") for node, name in zip(reads, read_names)
        ]

    def helpers(self) -> dict[str, object]:
        functions = (mark_step_counter_of_this_work, generation_of_this_work)
        return {ACCESSOR: steps_of_this_work, TORCH_TOTAL: BY_TORCH, **dict(zip(READS.values(), functions))}

    def per_thread_names(self) -> list[PerThreadName]:
        return [
            PerThreadName(
                TREES,
                "MarkStepBox.mark_step_counter",
                lambda trees: trees._cudagraph_mark_step_counter(),
                reset="torch._inductor.cudagraph_trees.reset_cudagraph_trees()",
            )
        ]


class _CountPerThread(SourcePatch):
    """torch's changes of ``GenerationTracker.generation`` in a Dynamo file (the increment on every compiled call,
    and ``clear()``) count for the calling thread and in BY_TORCH too."""

    def __init__(self, module: str, relpath: str) -> None:
        super().__init__(module, relpath)
        self.prefix = "" if module == GUARD else f"{GUARD}."

    def edits(self, source: str) -> list[Edit]:
        writes = _writes(parse(source), "generation")
        changes = sorted(_change(source, w) for w in writes)
        # Every release: one increment; from 2.4 mutation_guard's clear() (cls.generation = 0) too.
        if changes not in ([" += 1"], [" += 1", " = 0"]):
            raise ShapeError(f"{self.relpath}: expected one increment of GenerationTracker.generation (and a reset)")
        counters = (f"{self.prefix}{TORCH_TOTAL}.generation", f"{self.prefix}{THIS_THREAD}.steps.generation")
        return [_also_counted(source, w, *counters) for w in writes]

    def helpers(self) -> dict[str, object]:
        return {THIS_THREAD: THREAD_STEPS, TORCH_TOTAL: BY_TORCH} if self.module_name == GUARD else {}

    def per_thread_names(self) -> list[PerThreadName]:
        if self.module_name != GUARD:
            return []
        return [
            PerThreadName(
                GUARD,
                "GenerationTracker.generation",
                lambda _guard: sys.modules[TREES]._cudagraph_generation(),
                reset="torch._dynamo.reset()",
            )
        ]


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
    shared_state="torch._inductor.cudagraph_trees.MarkStepBox.mark_step_counter (cudagraph_mark_step_begin(), "
    "reset_cudagraph_trees()) and torch._dynamo.mutation_guard.GenerationTracker.generation (every compiled call, "
    "torch._dynamo.reset()): process counters every thread's CUDA graph trees compare to tell a new generation",
    symptom="one thread's `cudagraph_mark_step_begin()` (or compiled call) starts a new generation in every thread's "
    'trees, which overwrite outputs their own thread still needs: "accessing tensor output of CUDAGraphs that has '
    'been overwritten by a subsequent run" (H200, torch 2.11, 3 threads calling mark-step each step: 1 of 3 threads '
    "failed, 2 of 2 runs)",
    releases_note="CUDA graph trees from 2.1; both counters are process globals in every release through 2.15",
    scenarios=(Scenario(h7_cudagraph_step_counters, releases("2.1"), needs="CUDA graph trees (2.1+)"),),
    caveats=(
        "The class attributes stay the process's counters, which torch's code and direct writes change as without "
        "torchfix; a thread's trees read its own count plus what changed the attribute other than torch (a direct "
        "write, as torch's `test_checkpointing_resets_persistent_refs` makes, reaches every thread, as without "
        "torchfix); `torch._dynamo.reset()` and `reset_cudagraph_trees()` reset the calling thread's count. On "
        "Python < 3.10 and free-threaded builds, where `+= 1` from several threads loses updates, the trees read "
        "their thread's own count only: a direct write does not reach them there."
    ),
    survey_rows=(
        "torch/_dynamo/mutation_guard.py: GenerationTracker.generation",
        "torch/_inductor/cudagraph_trees.py: MarkStepBox.mark_step_counter",
    ),
)
