"""cudagraph-thread-trees: every thread gets CUDA graph trees of its own, captures one at a time, and takes
its trees along when it ends (H7).

``torch.compile(mode="reduce-overhead")`` runs compiled graphs as CUDA graphs kept in trees, one tree
manager per device in a container dict that ``torch._inductor.cudagraph_trees`` keeps in a
``threading.local``. Up to torch 2.12 that dict is made once, at import, in the importing thread (and
stashed in the C++ thread-local state, which autograd's device threads inherit from the thread whose
backward they run). Any other thread's first CUDA graph dies in ``get_obj`` with ``AssertionError``
(``assert torch._C._is_key_in_tls(attr_name)``; upstream issue #123177).

On torch 2.1 - 2.12 this backports the first two parts of upstream's fix (pytorch/pytorch#184357, 2.13):

* ``get_obj`` initialises a thread's containers on first use (``_initialize_tls``, as 2.13 names it),
  stashed in the C++ thread-local state too, so the device thread running this thread's backward finds
  the same trees;
* ``graph_capture_lock``, one process-wide lock around a tree manager's start (a synchronize and an
  empty capture), its warm-up runs (``run_eager``) and its recordings (``record_function``): CUDA graph
  capture and the caching allocator's private pools are process-wide, so one thread's synchronize or pool
  switch would invalidate another thread's capture. Replays are not serialised.

On every release, 2.13 - 2.15 included (whose ``_initialize_tls`` is upstream's), the thread's stash
entries are taken out when the thread ends (``patching.stash``): left in, C++ thread-exit code tears the
trees down after Python let the thread go. What upstream still shares between threads is in
``cudagraph-tree-callable`` and ``cudagraph-step-counters``.
"""

from __future__ import annotations

import ast
import importlib
import threading
import types
from collections import defaultdict
from collections.abc import Callable

from .._fix import Fix, Scenario, minor_release, releases
from ..doctor.scenarios import Result, in_thread
from ..patching.patches import SourcePatch
from ..patching.source import Edit, ShapeError, definitions, find_replaced, replace_node, segment
from ..patching.stash import adopt_until_thread_end, stash_until_thread_end

MODULE = "torch._inductor.cudagraph_trees"
LOCK = "graph_capture_lock"
INIT = "_initialize_tls"
STASH = "_stash_until_thread_end"
STASHED = ("tree_manager_containers", "tree_manager_locks")  # a thread's keys in the C++ thread-local stash


def _initialize_tls(local: threading.local) -> None:
    """The calling thread's tree containers, as torch 2.13's ``_initialize_tls`` makes them, taken out of the
    C++ stash again when the thread ends."""
    local.tree_manager_containers = {}
    local.tree_manager_locks = defaultdict(threading.Lock)
    # The C++ copy is what autograd's device threads see while they run this thread's backward.
    for key in STASHED:
        stash_until_thread_end(key, getattr(local, key))


class _TreesPatch(SourcePatch):
    """A patch of ``cudagraph_trees`` that also takes over the entries torch stashed at import."""

    def __init__(self) -> None:
        super().__init__(MODULE, "torch/_inductor/cudagraph_trees.py")

    def _install_state(self, module: types.ModuleType, source: str) -> None:
        super()._install_state(module, source)
        # With torchfix imported first, the fix applies in the thread that imports cudagraph_trees, right after
        # the module stashed that thread's containers: they are released at its end like every other thread's.
        for key in STASHED:
            adopt_until_thread_end(key)


class _TreesPerThread(_TreesPatch):
    """torch 2.1 - 2.12: a thread's containers made on first use, and ``graph_capture_lock``."""

    def describe(self) -> str:
        return super().describe() + f"; adds {INIT} and {LOCK} (torch 2.13's)"

    def edits(self, source: str) -> list[Edit]:
        functions = definitions(source)
        get_obj = functions.get("get_obj")
        asserts = [n for n in ast.walk(get_obj) if isinstance(n, ast.Assert)] if get_obj else []
        if len(asserts) != 1 or segment(source, asserts[0].test) != "torch._C._is_key_in_tls(attr_name)":
            raise ShapeError(f"{self.relpath}: get_obj is not the shape of torch 2.1 - 2.12")
        edits = [replace_node(asserts[0], f"if not torch._C._is_key_in_tls(attr_name): {INIT}(local)")]

        prefix = "CUDAGraphTreeManager."
        manager = {name: f for name, f in functions.items() if name.startswith(prefix)}
        if prefix + "__init__" not in manager:
            raise ShapeError(f"{self.relpath}: no CUDAGraphTreeManager.__init__")
        (starts,) = find_replaced(
            self.relpath,
            manager[prefix + "__init__"],
            "`with torch.cuda.device(device_index)` in the manager",
            lambda node: (
                isinstance(node, ast.With)
                and [segment(source, item.context_expr) for item in node.items] == ["torch.cuda.device(device_index)"]
            ),
        )
        start = starts.items[0].context_expr
        edits.append(replace_node(start, f"{LOCK}, {segment(source, start)}"))

        for method in ("run_eager", "record_function"):
            (call,) = find_replaced(
                self.relpath,
                manager.values(),
                f"call of self.{method}",
                lambda stmt, method=method: (
                    isinstance(stmt, (ast.Return, ast.Assign))
                    and isinstance(stmt.value, ast.Call)
                    and segment(source, stmt.value.func) == f"self.{method}"
                ),
            )
            edits.append(replace_node(call, f"with {LOCK}: {segment(source, call)}"))
        return edits

    def helpers(self) -> dict[str, object]:
        return {LOCK: threading.Lock(), INIT: _initialize_tls}


class _ReleaseAtThreadEnd(_TreesPatch):
    """torch 2.13+: upstream's ``_initialize_tls`` stashes through ``_stash_until_thread_end``."""

    def describe(self) -> str:
        return super().describe() + f"; {INIT} stashes until the thread ends"

    def edits(self, source: str) -> list[Edit]:
        stashes = find_replaced(
            self.relpath,
            definitions(source).get(INIT),
            f"calls of torch._C._stash_obj_in_tls in {INIT} (torch 2.13 - 2.15)",
            lambda node: isinstance(node, ast.Call) and segment(source, node.func) == "torch._C._stash_obj_in_tls",
            count=2,
        )
        return [replace_node(call.func, STASH) for call in stashes]

    def helpers(self) -> dict[str, object]:
        return {STASH: stash_until_thread_end}


def _patches(torch_version: str) -> list[SourcePatch]:
    backported = minor_release(torch_version) < (2, 13)
    return [_TreesPerThread() if backported else _ReleaseAtThreadEnd()]


def _probe() -> str | None:
    module = importlib.import_module(MODULE)
    init = vars(module).get(INIT)
    if init is not None and "_stash_obj_in_tls" not in init.__code__.co_names:
        return f"{INIT} keeps nothing in the C++ thread-local stash (a later upstream fix)"
    return None


def h7_cudagraph_trees_in_new_thread(timeout: float = 60.0) -> Result | None:
    """A thread other than the importing one asks for its CUDA graph tree container (what its first
    ``mode="reduce-overhead"`` graph does): torch 2.1 - 2.12 fail in ``get_obj``. Needs no GPU."""
    try:
        from torch._inductor import cudagraph_trees
    except ImportError:
        return None  # torch 2.0: no CUDA graph trees
    main = cudagraph_trees.get_container(0)
    other = in_thread(lambda: cudagraph_trees.get_container(0), timeout)
    if isinstance(other, BaseException):
        return Result("H7 (CUDA graph trees in a new thread)", True, f"raised {type(other).__name__}: {other}")
    shared = other is main
    return Result("H7 (CUDA graph trees in a new thread)", shared, "shares the main thread's" if shared else "ok")


def _trees_stashed_at_thread_end(make_trees: Callable[[], object], timeout: float) -> BaseException | list[bool]:
    """Run ``make_trees`` in a thread that then ends: what it raised, or whether its tree containers were still
    in torch's C++ thread-local stash when Python dropped the thread's thread-local values (one entry)."""
    import torch

    key, stashed_at_end = "tree_manager_containers", []

    class AtThreadEnd:
        # First used after the trees' own thread-local values (and torchfix's releaser), so dropped after them.
        # Before torch 2.13 an entry cannot be removed, only overwritten with None.
        def __del__(self) -> None:
            stashed_at_end.append(torch._C._is_key_in_tls(key) and torch._C._get_obj_in_tls(key) is not None)

    at_end = threading.local()

    def run() -> None:
        make_trees()
        at_end.probe = AtThreadEnd()

    error = in_thread(run, timeout)
    return error if isinstance(error, BaseException) else stashed_at_end


def h7_cudagraph_trees_at_thread_end(timeout: float = 60.0) -> Result | None:
    """A thread makes its CUDA graph tree containers (what its first ``mode="reduce-overhead"`` graph does) and
    ends. When Python drops its thread-local values, at the thread's end, the containers must be out of torch's
    C++ thread-local stash: left there, C++ thread-exit code tears the thread's trees down after Python let
    the thread go (torch 2.13 - 2.15; 2.1 - 2.12 give a thread no trees of its own without torchfix). No GPU."""
    try:
        from torch._inductor import cudagraph_trees
    except ImportError:
        return None
    scenario = "H7 (CUDA graph trees at a thread's end)"
    seen = _trees_stashed_at_thread_end(lambda: cudagraph_trees.get_container(0), timeout)
    if isinstance(seen, BaseException):
        return Result(scenario, True, f"no trees of its own: {type(seen).__name__}: {seen}")
    if seen != [False]:
        return Result(scenario, True, f"still in the C++ thread-local stash at the thread's end: {seen}")
    return Result(scenario, False, "taken out of the C++ thread-local stash by the thread")


# The importing thread's containers, kept for the process: without the fix torch 2.1 - 2.12 drop a reference
# to them that they never took, when that thread's C++ state goes.
_importers_trees: list[object] = []


def h7_cudagraph_trees_importer_ends(timeout: float = 60.0) -> Result | None:
    """A worker thread is the first to import CUDA graph trees (as the first thread to compile a
    ``mode="reduce-overhead"`` graph does), and ends. torch stashes the importing thread's containers at import;
    they too must be out of the C++ thread-local stash at the thread's end (up to 2.12 that entry also holds no
    reference of its own, so at the OS thread's exit it drops one from containers Python has freed). Needs a
    process that has not imported CUDA graph trees yet (the hazard tests run it in a fresh one). No GPU."""
    import importlib.util
    import sys

    if MODULE in sys.modules or importlib.util.find_spec(MODULE) is None:
        return None

    def import_trees() -> None:
        _importers_trees.append(importlib.import_module(MODULE).local.tree_manager_containers)

    scenario = "H7 (CUDA graph trees imported by a thread that ends)"
    seen = _trees_stashed_at_thread_end(import_trees, timeout)
    if isinstance(seen, BaseException):
        return Result(scenario, True, f"raised {type(seen).__name__}: {seen}")
    if seen != [False]:
        return Result(scenario, True, f"still in the C++ thread-local stash at the thread's end: {seen}")
    return Result(scenario, False, "taken out of the C++ thread-local stash by the thread")


FIX = Fix(
    name="cudagraph-thread-trees",
    order=170,
    needs_cuda=True,
    hazard="mode='reduce-overhead' in a thread other than the one that imported CUDA graph trees fails "
    "(AssertionError in cudagraph_trees.get_obj; torch 2.1 - 2.12), threads' graph captures break each other, "
    "and a thread's trees are torn down by C++ thread-exit code after Python let the thread go",
    versions=releases("2.1"),
    probe=_probe,
    patches=_patches,
    trigger=MODULE,
    scenarios=(
        Scenario(h7_cudagraph_trees_in_new_thread, releases("2.1", "2.12"), needs="CUDA graph trees (2.1+)"),
        # On 2.1 - 2.12 a thread has no trees of its own without the fix, which the scenario reports as the hazard.
        Scenario(h7_cudagraph_trees_at_thread_end, releases("2.1"), needs="CUDA graph trees (2.1+)"),
        Scenario(
            h7_cudagraph_trees_importer_ends,
            releases("2.1"),
            shows="still in the C++ thread-local stash",
            needs="CUDA graph trees (2.1+), not yet imported",
        ),
    ),
    shared_state=(
        'H7: CUDA graph trees (`mode="reduce-overhead"`) keep their containers in a `threading.local` set up only'
        " in the thread that imported `torch._inductor.cudagraph_trees` (≤ 2.12), nothing serialises graph "
        "captures (≤ 2.12), and a thread's containers stay in torch's C++ thread-local stash after the thread "
        "ends (every release)"
    ),
    symptom=(
        "every other thread's first CUDA graph raises `AssertionError` in `cudagraph_trees.get_obj`; threads' "
        "captures break each other; a thread's trees are torn down by C++ thread-exit code after Python let the "
        'thread go, which can abort the process at exit ("terminate called without an active exception")'
    ),
    releases_note="on 2.13+, which fixed the first two upstream, only the third; 2.0 has no trees",
    caveats=(
        "The three `cudagraph-*` fixes make the trees per thread the way autograd needs: a thread's containers, "
        "its callable per graph and its step counters are reached through the C++ thread-local stash that "
        "autograd's device thread inherits from the thread whose backward it runs, so each thread's backward "
        "replays in that thread's own tree. `cudagraph-thread-trees` backports torch 2.13's lazy per-thread "
        "containers and `graph_capture_lock`; the other two are beyond what upstream has in 2.15. What a thread "
        "puts in that stash (its containers, its step counters) is taken out again when the thread ends, while "
        "the thread still runs Python: C++ destroys the stash only when the OS thread exits, after `join()` has "
        "returned, and torch's objects then die in a C++ destructor that takes the GIL for a thread Python has "
        "already let go (upstream added `_remove_obj_from_tls`, 2.13+, after a deadlock of this kind, "
        "pytorch/pytorch#182083; before 2.13 the entries are overwritten with `None`). That includes the "
        "containers torch stashes at import in the importing thread, whichever thread first compiles a "
        "`reduce-overhead` graph; up to torch 2.12 that entry also holds no reference of its own yet drops one "
        "when it goes, so torchfix gives it one. On torch 2.13 (CPU), a process whose one extra thread made its "
        'trees and was joined aborted at exit ("terminate called without an active exception") in 3 of 78 runs '
        "without this (2 of 6, 1 of 12 and 0 of 60 in three batches, the first two on a busier machine), and in 0"
        " of 72 with it; the self-test shows the trees still in the stash at the thread's end, every run."
    ),
    survey_rows=("torch/_inductor/cudagraph_trees.py: local.tree_manager_containers / tree_manager_locks",),
)
