"""fx-codegen-names: the names a thread writes for a graph's nodes, while it writes the graph's code, are its own.

``Graph.python_code`` (every ``GraphModule.recompile``, and a ``_LazyGraphModule``'s first call, which is where the
graphs of Dynamo and AOTAutograd get their code) names the nodes through a namespace of that call: for its whole
duration it sets every node's ``_repr_fn`` to that namespace's naming function, then puts back what it found. The
nodes are shared, the setting is not per thread. Two threads that write one graph's code at once (two drafter
threads' first calls of one compiled layer's graph) name nodes in each other's namespace, and each puts back what
it found when it began, the other's function or none: a node gets one name where the code defines it and another
where it uses it. The forward raises ``UnboundLocalError`` (or ``NameError``) at every call, for good. Every
release 2.0 - 2.15 has it; seen in the trainer's tests on 2.13 (``cannot access local variable 'getitem'`` in
AOTAutograd's forward graph; 2 of 11 runs of that test with ``sys.setswitchinterval(1e-5)``, 0 of 10 with the
fix), and 17 of 400 codegens of one graph by two threads came out wrong there.

The naming moves to per-thread storage: ``python_code`` keeps (graph, naming function) in a ``threading.local``
(``_torchfix_codegen_names``) for its duration instead of writing the nodes, and ``Node.__repr__`` uses it for
the nodes of that graph in that thread. (``override_node_repr``, the nested function that wrote them, stays in the
file, uncalled.)
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import random
import threading
from collections.abc import Callable, Iterator

from .._fix import Fix, Scenario, SoakAction, SoakCheck, releases
from ..doctor.scenarios import Result, hold, line_of, started_thread, stopping
from ..patching.patches import SourcePatch, per_thread_class
from ..patching.source import Edit, ShapeError, definition, find_replaced, iter_code, replace_node, segment

HELPER = "_torchfix_codegen_names"


class CodegenNames(per_thread_class("CodegenNames", {"graph": None, "node_repr": None}, {}, seen_in_backward=False)):
    """The graph whose code this thread is writing, and the naming function of that ``python_code`` call (a
    graph's code is written in the thread that calls ``python_code``, never in a backward)."""

    graph: object
    node_repr: Callable[[object], str] | None

    @contextlib.contextmanager
    def naming(self, graph: object, node_repr: Callable[[object], str]) -> Iterator[None]:
        outer = self.graph, self.node_repr  # a graph's code written while another's is (nested), then put back
        self.graph, self.node_repr = graph, node_repr
        try:
            yield
        finally:
            self.graph, self.node_repr = outer

    def repr_fn(self, node: object) -> Callable[[object], str] | None:
        """What ``Node.__repr__`` calls: this thread's naming function for the graph it writes, else the node's own."""
        return self.node_repr if node.graph is self.graph else node._repr_fn  # type: ignore[attr-defined]


class _UsesNames(SourcePatch):
    """An edit of one file that refers to the fix's one ``CodegenNames`` (as ``_torchfix_codegen_names``)."""

    def __init__(self, module: str, relpath: str, names: CodegenNames) -> None:
        super().__init__(module, relpath)
        self._names = names  # not a setting: the cached edits do not depend on it

    def describe(self) -> str:
        return super().describe() + f"; adds {HELPER}, the graph each thread writes code for and its names"

    def helpers(self) -> dict[str, object]:
        return {HELPER: self._names}


class _GraphNaming(_UsesNames):
    """``Graph.python_code`` names the nodes through the calling thread's ``CodegenNames``."""

    def __init__(self, names: CodegenNames) -> None:
        super().__init__("torch.fx.graph", "torch/fx/graph.py", names)

    def edits(self, source: str) -> list[Edit]:
        (override,) = find_replaced(
            self.relpath,
            [
                item
                for node in ast.walk(definition(source, self.relpath, "Graph.python_code"))
                if isinstance(node, ast.With)
                for item in node.items
            ],
            "`with override_node_repr(self)` in Graph.python_code",
            lambda node: (
                isinstance(node, ast.withitem) and segment(source, node.context_expr) == "override_node_repr(self)"
            ),
        )
        return [replace_node(override.context_expr, f"{HELPER}.naming(self, node_repr)")]


class _NodeRepr(_UsesNames):
    """``Node.__repr__`` asks the calling thread's ``CodegenNames`` for its naming function."""

    def __init__(self, names: CodegenNames) -> None:
        super().__init__("torch.fx.node", "torch/fx/node.py", names)

    def edits(self, source: str) -> list[Edit]:
        function = definition(source, self.relpath, "Node.__repr__")
        tests = [n.test for n in function.body if isinstance(n, ast.If) and segment(source, n.test) == "self._repr_fn"]
        calls = [
            n for n in ast.walk(function) if isinstance(n, ast.Call) and segment(source, n) == "self._repr_fn(self)"
        ]
        if len(tests) != 1 or len(calls) != 1:
            raise ShapeError(f"{self.relpath}: Node.__repr__ is not `if self._repr_fn: return self._repr_fn(self)`")
        return [
            replace_node(tests[0], f"(_repr_fn := {HELPER}.repr_fn(self))"),
            replace_node(calls[0], "_repr_fn(self)"),
        ]


def _patches(_torch_version: str) -> list[SourcePatch]:
    names = CodegenNames()  # one object for both files: what python_code sets is what Node.__repr__ reads
    return [_GraphNaming(names), _NodeRepr(names)]


def _probe() -> str | None:
    graph = importlib.import_module("torch.fx.graph")
    if HELPER in vars(graph):
        return "the names of the code being written are per thread already"
    if not any("_repr_fn" in code.co_names for code in iter_code(graph.Graph.python_code.__code__)):
        return "Graph.python_code does not set its nodes' _repr_fn (changed upstream)"
    return None


def _relu_plus_one(x):
    import torch

    return torch.relu(x) + 1


def one_graph_written_twice(timeout: float = 60.0) -> Result:
    """Two threads write one graph's code at once. A is about to name the input x; B starts and is about to name x
    too; A names x and gets as far as taking the name ``relu`` for the next node; B names x, then that node; A
    files its name and ends; then B ends. Each thread's code must be what one thread alone writes."""
    import torch
    from torch.fx.graph import _Namespace

    graph = torch.fx.symbolic_trace(_relu_plus_one).graph
    alone = graph.python_code("self").src
    first, second = list(graph.nodes)[:2]
    create_name = _Namespace.create_name
    enter, files, named = (
        line_of(create_name, text) for text in ("if obj", "self._obj_to_name[obj] =", "return candidate")
    )
    reached = {point: threading.Event() for point in ("A at x", "A at relu", "B at x", "B named relu")}
    goes = {point: threading.Event() for point in reached}
    a_own: list[object] = []  # the namespace A's first name goes to: its own
    code: dict[str, str] = {}
    errors: dict[str, str] = {}

    def at(point: str, node: object, where: Callable[[object], bool] = lambda _namespace: True) -> Callable:
        """A stop that holds the thread at ``point`` when it names ``node`` in a namespace ``where`` accepts."""

        def stop(frame) -> bool | None:
            if frame.f_locals["obj"] is not node or not where(frame.f_locals["self"]):
                return False
            return hold(reached[point], goes[point], timeout)(frame)

        return stop

    def a_own_namespace(namespace: object) -> bool:
        a_own.append(namespace)
        return True

    def another_namespace(namespace: object) -> bool:
        return namespace is not a_own[0]  # with the fix A names relu in its own: the interleaving cannot happen

    def writer(name: str, stops: dict[int, Callable]) -> Callable[[], None]:
        return lambda: code.__setitem__(name, stopping(create_name, stops, lambda: graph.python_code("self").src))

    a_stops = {enter: at("A at x", first, a_own_namespace), files: at("A at relu", second, another_namespace)}
    a = started_thread("A", writer("A", a_stops), reached["A at relu"], errors)
    reached["A at x"].wait(timeout)
    b = started_thread(
        "B",
        writer("B", {enter: at("B at x", first), named: at("B named relu", second)}),
        reached["B named relu"],
        errors,
    )
    reached["B at x"].wait(timeout)
    goes["A at x"].set()
    reached["A at relu"].wait(timeout)  # or A ended: with the fix, A never names relu in B's namespace
    goes["B at x"].set()
    reached["B named relu"].wait(timeout)
    goes["A at relu"].set()
    a.join(timeout)
    goes["B named relu"].set()
    b.join(timeout)
    wrong = {
        name: next(
            (line.strip() for line, want in zip(src.splitlines(), alone.splitlines()) if line != want), src[-80:]
        )
        for name, src in code.items()
        if src != alone
    }
    detail = "; ".join(f"thread {name} wrote `{line}`" for name, line in sorted(wrong.items())) or "both wrote it right"
    detail += "".join(f"; {name} raised {error[:200]}" for name, error in sorted(errors.items()))
    return Result("one graph's code written by two threads at once", bool(wrong or errors), detail)


def _chain(x):
    for _ in range(100):
        x = x.relu() + x.sin()
    return x


def soak_graph_code() -> Callable[[random.Random], None]:
    """The soak's ``graph code``: every thread writes the code of one shared graph again (what threads' first calls
    of one compiled graph do); it must come out as it was, and compute what it did."""
    import torch
    import torch.fx

    graph = torch.fx.symbolic_trace(_chain)
    code = graph.code

    def write(rng: random.Random) -> None:
        graph.recompile()
        x = torch.full((2,), float(rng.randint(-3, 3)))
        assert graph.code == code, "graph code written wrong (names of another thread's writing)"
        assert torch.equal(graph(x), _chain(x)), "graph code gave a wrong result"

    return write


FIX = Fix(
    name="fx-codegen-names",
    order=85,
    hazard="two threads writing one graph's code at once (two first calls of one compiled graph) name its nodes "
    "in each other's namespace: the forward defines a node under one name and uses another (UnboundLocalError)",
    versions=releases("2.0"),
    probe=_probe,
    patches=_patches,
    scenarios=(Scenario(one_graph_written_twice, releases("2.0"), shows="wrote `"),),
    shared_state=(
        "`torch.fx.Graph.python_code` (every `GraphModule.recompile`, and the first call of a `_LazyGraphModule`:"
        " every graph Dynamo and AOTAutograd make) points each node's `_repr_fn` at its own namespace while it "
        "writes the graph's code, then puts back what it found; the nodes are shared between threads"
    ),
    symptom=(
        "two threads writing one graph's code at once (the trainer's two drafter threads both write the code of "
        "the compiled layer's graphs) name its nodes in each other's namespace: the forward defines a node under "
        "one name and uses another, and raises `UnboundLocalError: cannot access local variable 'getitem'` at "
        "every call (a CI run of the trainer's tests, torch 2.13; the same smoke run with "
        "`sys.setswitchinterval(1e-5)`: 2 of 11 runs so without the fix, 0 of 10 with it); 11 – 17 of 400 "
        "codegens of one graph by two threads came out wrong. The naming is now the writing thread's"
    ),
    soak=SoakCheck(
        # A node defined under one name and used under another: Python 3.11's words, then 3.10's.
        errors=("graph code", "cannot access local variable", "referenced before assignment"),
        actions=(SoakAction("graph code", 2, soak_graph_code),),
    ),
    survey_rows=("torch/fx/graph.py: Node._repr_fn of the graph's nodes",),
)
