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
entries are taken out when the thread ends (``_thread_stash``): left in, C++ thread-exit code tears the
trees down after Python let the thread go. What upstream still shares between threads is in
``cudagraph-tree-callable`` and ``cudagraph-step-counters``.
"""

from __future__ import annotations

import ast
import importlib
import threading
from collections import defaultdict

from .._fix import Fix, Scenario, minor_release, releases
from .._patch import SourcePatch
from .._selftest import Result, in_thread
from .._source import Edit, ShapeError, definitions, replace_node, segment
from ._thread_stash import stash_until_thread_end

MODULE = "torch._inductor.cudagraph_trees"
LOCK = "graph_capture_lock"
INIT = "_initialize_tls"
STASH = "_stash_until_thread_end"


def _initialize_tls(local: threading.local) -> None:
    """The calling thread's tree containers, as torch 2.13's ``_initialize_tls`` makes them, taken out of the
    C++ stash again when the thread ends."""
    local.tree_manager_containers = {}
    local.tree_manager_locks = defaultdict(threading.Lock)
    # The C++ copy is what autograd's device threads see while they run this thread's backward.
    stash_until_thread_end("tree_manager_containers", local.tree_manager_containers)
    stash_until_thread_end("tree_manager_locks", local.tree_manager_locks)


class _TreesPerThread(SourcePatch):
    def __init__(self) -> None:
        super().__init__(MODULE, "torch/_inductor/cudagraph_trees.py")

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
        starts = [
            node
            for node in ast.walk(manager[prefix + "__init__"])
            if isinstance(node, ast.With)
            and [segment(source, item.context_expr) for item in node.items] == ["torch.cuda.device(device_index)"]
        ]
        if len(starts) != 1:
            raise ShapeError(f"{self.relpath}: expected one `with torch.cuda.device(device_index)` in the manager")
        start = starts[0].items[0].context_expr
        edits.append(replace_node(start, f"{LOCK}, {segment(source, start)}"))

        for method in ("run_eager", "record_function"):
            calls = [
                stmt
                for function in manager.values()
                for stmt in ast.walk(function)
                if isinstance(stmt, (ast.Return, ast.Assign))
                and isinstance(stmt.value, ast.Call)
                and segment(source, stmt.value.func) == f"self.{method}"
            ]
            if len(calls) != 1:
                raise ShapeError(f"{self.relpath}: expected one call of self.{method}, found {len(calls)}")
            edits.append(replace_node(calls[0], f"with {LOCK}: {segment(source, calls[0])}"))
        return edits

    def helpers(self) -> dict[str, object]:
        return {LOCK: threading.Lock(), INIT: _initialize_tls}


class _ReleaseAtThreadEnd(SourcePatch):
    """torch 2.13+: upstream's ``_initialize_tls`` stashes through ``_stash_until_thread_end``."""

    def __init__(self) -> None:
        super().__init__(MODULE, "torch/_inductor/cudagraph_trees.py")

    def describe(self) -> str:
        return super().describe() + f"; {INIT} stashes until the thread ends"

    def edits(self, source: str) -> list[Edit]:
        init = definitions(source).get(INIT)
        calls = [node for node in ast.walk(init) if isinstance(node, ast.Call)] if init is not None else []
        stashes = [call.func for call in calls if segment(source, call.func) == "torch._C._stash_obj_in_tls"]
        if len(stashes) != 2:
            raise ShapeError(f"{self.relpath}: expected {INIT} to stash two objects (torch 2.13 - 2.15)")
        return [replace_node(func, STASH) for func in stashes]

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


def h7_cudagraph_trees_at_thread_end(timeout: float = 60.0) -> Result | None:
    """A thread makes its CUDA graph tree containers (what its first ``mode="reduce-overhead"`` graph does) and
    ends. When Python drops its thread-local values, at the thread's end, the containers must be out of torch's
    C++ thread-local stash: left there, C++ thread-exit code tears the thread's trees down after Python let
    the thread go (torch 2.13 - 2.15; 2.1 - 2.12 give a thread no trees of its own without torchfix). No GPU."""
    import torch

    try:
        from torch._inductor import cudagraph_trees
    except ImportError:
        return None
    scenario, stashed_at_end = "H7 (CUDA graph trees at a thread's end)", []

    class AtThreadEnd:
        # First used after the trees' own thread-local values, so dropped after them. Before torch 2.13 an
        # entry cannot be removed, only overwritten with None.
        def __del__(self) -> None:
            key = "tree_manager_containers"
            stashed_at_end.append(torch._C._is_key_in_tls(key) and torch._C._get_obj_in_tls(key) is not None)

    at_end = threading.local()

    def make_trees() -> None:
        cudagraph_trees.get_container(0)
        at_end.probe = AtThreadEnd()

    error = in_thread(make_trees, timeout)
    if isinstance(error, BaseException):
        return Result(scenario, True, f"no trees of its own: {type(error).__name__}: {error}")
    if stashed_at_end != [False]:
        return Result(scenario, True, f"still in the C++ thread-local stash at the thread's end: {stashed_at_end}")
    return Result(scenario, False, "taken out of the C++ thread-local stash by the thread")


FIX = Fix(
    name="cudagraph-thread-trees",
    order=170,
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
    ),
)
