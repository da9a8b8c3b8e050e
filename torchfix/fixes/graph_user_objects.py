"""graph-user-objects: the user objects a compiled graph runs with belong to the thread that called it.

Dynamo passes some objects to its graphs through a side table rather than as graph inputs: CUDA streams and
events (used or made in the compiled code; from 2.12 every compile on a machine with an accelerator registers the
current stream), nn.Modules passed to a ``leaf_function`` (2.11+), a memory pool (2.14+). The graph looks them up
by index at run time (``get_external_object_by_index``, also from Inductor's generated code, the stream custom ops
and ``invoke_leaf_function``). ``torch._dynamo.graph_bytecode_inputs`` keeps that table and its companions in module
globals: ``index_to_external_object_weakref`` (the objects), ``index_to_bytecode_constructor`` (how the compiled
bytecode gets each one, written while Dynamo traces and read when it generates the bytecode) and ``keep_alive``.
Every compile clears all three (``reset_user_object_tracking``) and fills them while it traces; every call of a
compiled frame that has such objects first stores the caller's objects in the table
(``store_user_object_weakrefs``, 2.10 - 2.14 in place, 2.15 by rebinding it), then runs its graph. As process
globals, a graph running in one thread looks up what another thread's call stored since: its leaf function runs the
other thread's module, silently (reproduced on 2.13, 2.14.1 and 2.15), its stream ops use the other thread's streams,
or, after another thread's compile cleared the table, it raises ``AssertionError: Index not registered``. Globals
from 2.10 (which added the module) to 2.15.

The three move to per-thread storage (``graph_bytecode_inputs._user_objects_tls``) with :class:`ThreadLocalGlobals`:
each thread gets its own tables, made empty on first use. That is enough because everything a graph's run reads is
written by the same call in the same thread (the bytecode's store, then the graph), and everything a compile reads
by the same compile (registrations while tracing, then the bytecode generation): a thread calling a graph another
thread compiled stores its own objects first, as upstream does for each call. What else reads them by name gets
the calling thread's too (:class:`ImportedNameUses`): ``output_graph`` imports ``index_to_bytecode_constructor`` by
name, and AOTAutograd's ``runtime_wrappers`` (2.14+) ``index_to_external_object_weakref``, to snapshot a forward's
objects for its backward (on 2.15 upstream's copy is the list from import, which the store's rebinding leaves
stale even in one thread; it now reads the live table). A backward on autograd's CUDA device thread sees the
tables of the thread whose backward it runs from 2.13 (torch's C++ stash, :class:`ThreadSpaces`); on 2.10 - 2.12
it sees empty ones, so a compiled backward that syncs user streams there raises "Index not registered", where
torch alone reads what the last forward stored.
"""

from __future__ import annotations

import importlib.util
import threading
import types

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result, fresh, torch_module
from ..patching.patches import ImportedNameUses, ThreadLocalGlobals, moved_global_probe

MODULE = "torch._dynamo.graph_bytecode_inputs"
HOLDER = "_user_objects_tls"
TABLES = {
    "index_to_external_object_weakref": "objects",
    "index_to_bytecode_constructor": "constructors",
    "keep_alive": "keep_alive",
}
# The modules that import a table by name (output_graph: every release; runtime_wrappers: 2.14+).
_BY_NAME = ("torch._dynamo.output_graph", "torch._functorch._aot_autograd.runtime_wrappers")


def _probe() -> str | None:
    if importlib.util.find_spec(MODULE) is None:
        return f"torch has no {MODULE} (before 2.10): no side table of user objects"
    return moved_global_probe(MODULE, HOLDER, "index_to_external_object_weakref", f"{MODULE} has no table")()


class _SideTables(ThreadLocalGlobals):
    """The tables per thread; when the fix goes, the module gets back the very objects it had (holding the calling
    thread's entries), which the modules that imported them by name still hold."""

    def __init__(self) -> None:
        super().__init__(MODULE, MODULE.replace(".", "/") + ".py", HOLDER, TABLES, seen_in_backward=True)
        self._originals: dict[str, list | dict] = {}

    def describe(self) -> str:
        return super().describe() + "; when removed, the module gets back its own table objects"

    def _install_state(self, module: types.ModuleType, source: str) -> None:
        self._originals = {name: vars(module)[name] for name in TABLES}
        super()._install_state(module, source)

    def _remove_state(self, module: types.ModuleType) -> None:
        super()._remove_state(module)
        namespace = vars(module)
        for name, table in self._originals.items():
            entries = namespace[name]
            if entries is not table:
                table.clear()
                if isinstance(table, dict):
                    table.update(entries)
                else:
                    table.extend(entries)
                namespace[name] = table
        self._originals = {}


def _patches(_torch_version: str) -> list[ThreadLocalGlobals | ImportedNameUses]:
    return [
        _SideTables(),
        *(ImportedNameUses(module, module.replace(".", "/") + ".py", MODULE, HOLDER, TABLES) for module in _BY_NAME),
    ]


def leaf_module_elsewhere(timeout: float = 60.0) -> Result | None:
    """Thread A calls a compiled function that runs its module twice through a ``leaf_function``; its first run
    waits while the main thread calls the same function with its own module. A's second run must run A's module
    again. None where torch has no ``leaf_function`` (before 2.11)."""
    import torch

    leaf_function = getattr(torch_module("torch._dynamo.decorators"), "leaf_function", None)
    if leaf_function is None:
        return None
    ran: list[tuple[str, str]] = []  # (the thread, the module it ran)
    inside, release = threading.Event(), threading.Event()

    class Tagged(torch.nn.Module):
        def __init__(self, tag: str) -> None:
            super().__init__()
            self.tag = tag

        def forward(self, x):
            ran.append((threading.current_thread().name, self.tag))
            if threading.current_thread().name == "A" and not inside.is_set():
                inside.set()
                release.wait(timeout)
            return x + 1

    @leaf_function
    def run(mod, x):
        return (mod(x),)

    @run.register_fake
    def _(mod, x):
        return (torch.empty_like(x),)

    def twice(mod, x):
        return run(mod, run(mod, x)[0])[0]

    compiled = torch.compile(fresh(twice), backend="eager", fullgraph=True)
    modules = {"A": Tagged("A's"), "MainThread": Tagged("the main thread's")}
    for module in modules.values():  # compiled for both, before the threads meet
        compiled(module, torch.ones(2))
    ran.clear()
    errors: list[str] = []

    def call_in_a() -> None:
        try:
            compiled(modules["A"], torch.ones(2))
        except Exception as exc:
            errors.append(f"A's call raised {type(exc).__name__}: {exc}")
        finally:
            inside.set()

    thread = threading.Thread(target=call_in_a, name="A", daemon=True)
    thread.start()
    inside.wait(timeout)
    try:
        compiled(modules["MainThread"], torch.ones(2))
    finally:
        release.set()
        thread.join(timeout)
    wrong = [(who, tag) for who, tag in ran if tag != modules[who].tag]
    said = "; ".join(f"thread {who} ran {tag} module" for who, tag in ran)
    detail = "; ".join([said, *errors]) + (" (the other thread's)" if wrong else "")
    return Result(
        "user objects of compiled graphs (a leaf module passed in two threads at once)", bool(wrong or errors), detail
    )


FIX = Fix(
    name="graph-user-objects",
    order=370,
    hazard="a compiled graph looks its user objects (streams, events, leaf-function modules) up in one table for the "
    "process, which every compiled call rebinds: it runs another thread's module or stream, silently",
    versions=releases("2.10"),
    probe=_probe,
    patches=_patches,
    trigger="torch._dynamo",
    scenarios=(
        Scenario(
            leaf_module_elsewhere,
            releases("2.11"),
            needs="torch._dynamo.decorators.leaf_function (2.11+)",
            shows="the other thread's",
        ),
    ),
    shared_state=(
        "`torch._dynamo.graph_bytecode_inputs` keeps the user objects a compiled graph looks up by index (CUDA "
        "streams and events, `leaf_function` modules, a memory pool) in process globals: every call of such a "
        "graph first stores its caller's objects there, every compile clears them"
    ),
    symptom=(
        "a graph running in one thread looks up what another thread's call stored since: its `leaf_function` runs"
        " the other thread's module, silently (torch 2.13, 2.14.1, 2.15: every run of the self-test), its stream "
        "ops use the other thread's streams; after another thread's compile, `AssertionError: Index not "
        "registered`"
    ),
    releases_note='before 2.10 no such table: "not needed"',
    caveats=(
        "`graph-user-objects` gives each thread its own tables: a graph another thread compiled works in a thread"
        " that calls it, since every call stores its own objects first. A backward that autograd runs on its CUDA"
        " device thread sees the tables of the thread whose backward it is from torch 2.13; on 2.10 – 2.12 it "
        "sees empty ones, so a compiled backward that syncs streams the forward used (`torch.cuda.stream` inside "
        'the compiled code) raises "Index not registered" there, where torch alone reads what the last forward '
        "stored. On 2.15 AOTAutograd's snapshot of a forward's objects for its backward now reads the live table "
        "(torch's own by-name copy of it goes stale once a call has stored objects). On a machine with an "
        "accelerator (2.12+) every compiled call stores the current stream, so there each makes two Python calls "
        "more (reads of the per-thread table; 2.15: one), and from 2.14 every compiled training forward one more "
        "(the snapshot)."
    ),
    survey_rows=(
        "torch/_dynamo/graph_bytecode_inputs.py: index_to_external_object_weakref",
        "torch/_dynamo/graph_bytecode_inputs.py: index_to_bytecode_constructor",
        "torch/_dynamo/graph_bytecode_inputs.py: keep_alive",
    ),
)
