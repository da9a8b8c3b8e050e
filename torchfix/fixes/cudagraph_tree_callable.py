"""cudagraph-tree-callable: a compiled graph's CUDA graphs live in the tree of the thread whose work it is (H7).

Inductor wraps each graph compiled with ``mode="reduce-overhead"`` in ``compile_fx.cudagraphify``, which
makes the graph's CUDA-graph callable on its first call and keeps it: one callable for every thread up to
torch 2.12, and from 2.13 one per *calling* thread (a ``threading.local``, upstream pytorch/pytorch#184357).
The callable records into, and replays from, the tree of the thread that made it. Neither keying is right
for training in threads:

* shared (<= 2.12): every thread runs in the first thread's tree, so one thread's replay overwrites the
  outputs another thread still holds ("accessing tensor output of CUDAGraphs that has been overwritten
  by a subsequent run");
* per calling thread (2.13+): backward graphs run on autograd's CUDA device thread, one thread for all
  user threads, so every thread's backward lands in the tree of whichever thread's backward ran first.

The fix keys the callable by the tree of the thread whose work it is: ``cudagraph_trees.get_container``,
which on autograd's device thread returns the containers of the thread whose backward it runs (the C++
thread-local stash it inherits). ``cudagraphify`` builds its callable through a ``_cudagraphify_per_tree``
of its own, a dispatcher that makes one callable per tree; from 2.13 every calling thread gets that same
dispatcher from it (2.13's ``threading.local`` is left as it is: without CUDA graph trees it still keeps
torch's per-thread callables). Measured on an H200
(torch 2.11, 3 threads training with ``mode="reduce-overhead"``): keyed per calling thread, 2 of 3 threads
failed at step 1 in 3 of 3 runs; keyed per tree, all threads matched eager for 40 steps in 11 of 11 runs.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import threading
import weakref
from collections.abc import Callable, Sequence

from .._fix import Fix, releases
from ..patching.patches import SourcePatch
from ..patching.source import Edit, definition, find_replaced, replace_node, segment

MODULE = "torch._inductor.compile_fx"
TREES = "torch._inductor.cudagraph_trees"
HELPER = "_cudagraphify_per_tree"
CONTAINERS = "tree_manager_containers"  # of cudagraph_trees: its threading.local's, and a stash key


class PerTree:
    """A compiled graph's CUDA-graph callables, one per CUDA graph tree (per host thread and device).

    ``cudagraphify`` makes one per graph (``_cudagraphify_per_tree()`` in its ``functools.partial``) and
    calls it where it called ``cudagraphify_impl(model, inputs, static_input_idxs, **kwargs)``: in one
    thread up to 2.12, in every calling thread from 2.13. Each gets the same :meth:`dispatch` back, so the
    callables are per tree whichever threads call them.
    """

    def __init__(self) -> None:
        self._make: Callable[[list], Callable] | None = None
        self._device_index = -1
        # By a weak reference to the tree's container (a thread that ends takes its trees and their callables
        # along): a plain dict, so that a replay's lookup makes no Python call (WeakKeyDictionary.get is one).
        self._by_tree: dict[weakref.ref, Callable] = {}
        self._lock = threading.Lock()
        owner = weakref.ref(self)  # not self: the references in _by_tree keep this callback

        def forget(tree: weakref.ref) -> None:  # the tree is gone: a dead reference keeps the hash it was stored under
            per_tree = owner()
            if per_tree is not None:
                per_tree._by_tree.pop(tree, None)

        self._forget = forget

    def __call__(
        self, make: Callable, model: Callable, _inputs: object, static_input_idxs: Sequence[int] = (), **kwargs: object
    ) -> Callable[[list], object]:
        with self._lock:
            if self._make is None:  # the inputs are only looked at for which of them are ints: any call's do
                self._make = lambda inputs: make(model, inputs, static_input_idxs, **kwargs)
                self._device_index = kwargs["device_index"]
        return self.dispatch

    def dispatch(self, new_inputs: list) -> object:
        # Every replay comes here: the module from sys.modules, not an import statement, once it is loaded.
        trees = sys.modules.get(TREES) or importlib.import_module(TREES)
        # The tree get_container() returns, without its three calls where the tree is made already: the containers
        # as get_obj() finds them, in the module's threading.local, else (autograd's device thread) in the C++ stash
        # inherited from the thread whose backward runs.
        containers = getattr(trees.local, CONTAINERS, None)
        if containers is None:
            c = sys.modules["torch"]._C
            containers = c._get_obj_in_tls(CONTAINERS) if c._is_key_in_tls(CONTAINERS) else None
        tree = containers.get(self._device_index) if containers is not None else None
        if tree is None:
            tree = trees.get_container(self._device_index)
        fn = self._by_tree.get(weakref.ref(tree))
        if fn is None:
            with self._lock:
                fn = self._by_tree.get(weakref.ref(tree))
                if fn is None:
                    fn = self._by_tree[weakref.ref(tree, self._forget)] = self._make(new_inputs)
        return fn(new_inputs)


class _CallablePerTree(SourcePatch):
    def __init__(self) -> None:
        super().__init__(MODULE, "torch/_inductor/compile_fx.py")

    def describe(self) -> str:
        return super().describe() + f"; adds {HELPER}, which makes a graph's CUDA-graph callable once per tree"

    def edits(self, source: str) -> list[Edit]:
        (partial,) = find_replaced(
            self.relpath,
            definition(source, self.relpath, "cudagraphify"),
            "functools.partial(new_cudagraphify_impl, ...)",
            lambda node: (
                isinstance(node, ast.Call)
                and segment(source, node.func) == "functools.partial"
                and node.args
                and segment(source, node.args[0]) == "new_cudagraphify_impl"
            ),
        )
        return [replace_node(partial.args[0], f"{HELPER}(), new_cudagraphify_impl")]

    def helpers(self) -> dict[str, object]:
        return {HELPER: PerTree}


def _probe() -> str | None:
    module = importlib.import_module(MODULE)
    if HELPER in vars(module):
        return "CUDA-graph callables are per tree already"
    if importlib.util.find_spec(TREES) is None or not hasattr(module, "cudagraphify"):
        return "this torch has no CUDA graph trees (2.1+)"
    return None


FIX = Fix(
    name="cudagraph-tree-callable",
    order=180,
    needs_cuda=True,
    hazard="with mode='reduce-overhead', threads replay each other's CUDA graphs (overwritten outputs), and "
    "from torch 2.13 every thread's backward runs in the tree of the first thread whose backward ran",
    versions=releases("2.1"),
    probe=_probe,
    patches=lambda _torch_version: [_CallablePerTree()],
    trigger=MODULE,
    shared_state=(
        "H7: `compile_fx.cudagraphify` keeps a graph's CUDA-graph callable for every thread (≤ 2.12) or per "
        "*calling* thread (2.13+); backward graphs run on autograd's device thread, one for all threads"
    ),
    symptom=(
        '"accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run": threads replay '
        "each other's graphs, and from 2.13 every thread's backward lands in the first thread's tree"
    ),
    survey_rows=("torch/_inductor/compile_fx.py: cudagraphify's callable",),
)
