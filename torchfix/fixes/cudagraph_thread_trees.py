"""cudagraph-thread-trees: every thread gets CUDA graph trees of its own, and captures one at a time (H7).

``torch.compile(mode="reduce-overhead")`` runs compiled graphs as CUDA graphs kept in trees, one tree
manager per device in a container dict that ``torch._inductor.cudagraph_trees`` keeps in a
``threading.local``. Up to torch 2.12 that dict is made once, at import, in the importing thread (and
stashed in the C++ thread-local state, which autograd's device threads inherit from the thread whose
backward they run). Any other thread's first CUDA graph dies in ``get_obj`` with ``AssertionError``
(``assert torch._C._is_key_in_tls(attr_name)``; upstream issue #123177).

This backports the first two parts of upstream's fix (pytorch/pytorch#184357, torch 2.13):

* ``get_obj`` initialises a thread's containers on first use (``_initialize_tls``, as 2.13 names it),
  stashed in the C++ thread-local state too, so the device thread running this thread's backward finds
  the same trees;
* ``graph_capture_lock``, one process-wide lock around a tree manager's start (a synchronize and an
  empty capture), its warm-up runs (``run_eager``) and its recordings (``record_function``): CUDA graph
  capture and the caching allocator's private pools are process-wide, so one thread's synchronize or pool
  switch would invalidate another thread's capture. Replays are not serialised.

On 2.13+ torch has both: "not needed". What upstream still shares between threads is in
``cudagraph-tree-callable`` and ``cudagraph-step-counters``.
"""

from __future__ import annotations

import ast
import importlib
import threading
from collections import defaultdict

from packaging.specifiers import SpecifierSet

from .._fix import Fix
from .._patch import SourcePatch
from .._source import Edit, ShapeError, definitions, replace_node, segment

MODULE = "torch._inductor.cudagraph_trees"
LOCK = "graph_capture_lock"
INIT = "_initialize_tls"


def _initialize_tls(local: threading.local) -> None:
    """The calling thread's tree containers, as torch 2.13's ``_initialize_tls`` makes them."""
    import torch

    local.tree_manager_containers = {}
    local.tree_manager_locks = defaultdict(threading.Lock)
    # The C++ copy is what autograd's device threads see while they run this thread's backward.
    torch._C._stash_obj_in_tls("tree_manager_containers", local.tree_manager_containers)
    torch._C._stash_obj_in_tls("tree_manager_locks", local.tree_manager_locks)


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


def _probe() -> str | None:
    module = importlib.import_module(MODULE)
    if INIT in vars(module) and LOCK in vars(module):
        return "CUDA graph trees are per thread and captures serialised already (upstream fix, torch 2.13+)"
    return None


FIX = Fix(
    name="cudagraph-thread-trees",
    hazard="mode='reduce-overhead' in a thread other than the one that imported CUDA graph trees fails "
    "(AssertionError in cudagraph_trees.get_obj), and threads' graph captures break each other",
    versions=SpecifierSet(">=2.1,<2.13", prereleases=True),
    probe=_probe,
    patches=lambda _torch_version: [_TreesPerThread()],
    trigger=MODULE,
)
