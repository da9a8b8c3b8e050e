"""trace-patch-isolation: FX tracing patches act only in the tracing thread (hazard H4).

While ``Tracer.trace`` runs, it patches ``torch.nn.Module.__call__`` and ``__getattr__``, the functions
registered with ``torch.fx.wrap`` and the "autowrapped" ones it finds in the traced code's globals
(``math.sqrt`` ...), by writing into the class or the module dict: process-wide. Every other thread then runs
the tracer's wrappers: an eager module call in another thread goes to this tracer's ``call_module``
("NameError: module is not installed as a submodule"), and two tracers overlapping in time restore each
other's patches out of order (a trace that runs on with its patches gone, or patches left in place after
both finished). From 2.5 the active patcher is also a global, ``CURRENT_PATCHER``, and two overlapping
traces trip "AssertionError: CURRENT_PATCHER is None in finally block" or revert the other thread's patcher
(``_maybe_revert_all_patches``, entered by Dynamo for every frame it compiles). Present in every release
up to 2.15 (upstream pytorch/pytorch#187589 is not in a release yet).

The fix routes every patch through ``_thread_patches``, a per-slot dispatcher (``ThreadPatches`` of
``patching/slots.py``, shared with autograd-entry-patches: a slot is one name in one class or module dict;
other threads run the originals, and the last thread to revert restores them):

* the tracer's own reads of a slot (the deduplication check, the original it wraps, the autowrap scan)
  see the calling thread's view, never another thread's patch or the dispatcher;
* ``CURRENT_PATCHER`` (2.5+) becomes per-thread.

The edits replace one statement or expression each, on its own line, in ``_PatchedFn*.patch/revert``,
``_Patcher.patch/patch_method`` (2.0 - 2.4 write there directly), ``_patch_wrapped_functions``,
``_create_wrapped_method`` and ``_autowrap_check``.
"""

from __future__ import annotations

import ast
import random
import sys
import threading
import types
from collections.abc import Callable

from .._fix import Fix, Scenario, SoakAction, SoakCheck, releases
from ..doctor.scenarios import MODULE_GRAPH, HeldTrace, Result, fresh_add_one, graph_ops, module_around
from ..patching.patches import ThreadLocalGlobals
from ..patching.slots import ThreadPatches, skip_in_dynamo_when_imported
from ..patching.source import Edit, ShapeError, definitions, find_replaced, replace_node, segment

MODULE = "torch.fx._symbolic_trace"
HELPER = "_thread_patches"


def _slot_write(source: str, stmt: ast.stmt) -> tuple[str, str, str | None] | None:
    """``(owner, name, value)`` texts of ``owner[name] = value`` or ``setattr(owner, name, value)``;
    value None for ``del owner[name]``. None for any other statement."""

    def text(node: ast.AST) -> str:
        return segment(source, node)

    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Subscript):
        return text(stmt.targets[0].value), text(stmt.targets[0].slice), text(stmt.value)
    if isinstance(stmt, ast.Delete) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Subscript):
        return text(stmt.targets[0].value), text(stmt.targets[0].slice), None
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "setattr":
        return tuple(text(arg) for arg in call.args)  # type: ignore[return-value]
    return None


class _IsolationPatch(ThreadLocalGlobals):
    PATCH_KINDS = ("_PatchedFnSetItem", "_PatchedFnDel", "_PatchedFnSetAttr")

    def __init__(self) -> None:
        super().__init__(
            MODULE,
            "torch/fx/_symbolic_trace.py",
            "_current_patcher_tls",
            {"CURRENT_PATCHER": "patcher"},
            optional=frozenset({"CURRENT_PATCHER"}),  # 2.5+,
            seen_in_backward=True,
        )

    def describe(self) -> str:
        return super().describe() + f"; adds {HELPER}, which keeps the tracer's patches per thread"

    def edits(self, source: str) -> list[Edit]:
        functions = definitions(source)
        missing = {"_Patcher.patch", "_Patcher.patch_method", "_autowrap_check"} - functions.keys()
        if missing:
            raise ShapeError(f"{self.relpath}: no {', '.join(sorted(missing))}")
        edits = super().edits(source)  # CURRENT_PATCHER, where the file has it
        for qualname, func in functions.items():
            kind, _, method = qualname.partition(".")
            if kind in self.PATCH_KINDS and method in ("patch", "revert"):
                edits.append(self._write_edit(source, func, method))
            elif qualname in ("_Patcher.patch", "_Patcher.patch_method"):  # 2.0 - 2.4 write the slot here
                edits += [self._write_edit(source, stmt, "patch") for stmt in func.body if _slot_write(source, stmt)]
        edits += self._read_edits(source, functions)
        return edits

    @staticmethod
    def _write_edit(source: str, node: ast.FunctionDef | ast.stmt, method: str) -> Edit:
        stmt = node.body[0] if isinstance(node, ast.FunctionDef) else node
        write = _slot_write(source, stmt)
        if write is None or (isinstance(node, ast.FunctionDef) and len(node.body) != 1):
            raise ShapeError(f"line {stmt.lineno}: expected one write of a patched name")
        owner, name, value = write
        if method == "revert":
            return replace_node(stmt, f"{HELPER}.unset({owner}, {name})")
        return replace_node(stmt, f"{HELPER}.set({owner}, {name}, {value})")

    def _read_edits(self, source: str, functions: dict[str, ast.FunctionDef]) -> list[Edit]:
        """The tracer's reads of patched names: through the calling thread's view."""
        edits = []
        readers = ("_Patcher.patch", "_Patcher.patch_method", "_patch_wrapped_functions", "_create_wrapped_method")
        for qualname in readers:
            for node in ast.walk(functions[qualname]):
                if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                    owner, name = node.value, node.slice  # frame_dict[name]
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
                    if len(node.args) != 2 or not isinstance(node.args[1], ast.Name):
                        continue  # getattr(fn, "__fx_already_patched", False): not a slot
                    owner, name = node.args  # getattr(cls, name)
                else:
                    continue
                # getattr(builtins, name) names no slot: a patched builtin lives in the frame dict.
                if (
                    isinstance(owner, ast.Name)
                    and owner.id != "builtins"
                    and isinstance(name, ast.Name)
                    and name.id == "name"
                ):
                    edits.append(replace_node(node, f"{HELPER}.current({owner.id}, name)"))
        (items,) = find_replaced(
            self.relpath,
            functions["_autowrap_check"],
            "frame_dict.items() in _autowrap_check",
            lambda node: isinstance(node, ast.Call) and segment(source, node) == "frame_dict.items()",
        )
        return edits + [replace_node(items, f"{HELPER}.items(frame_dict)")]

    def helpers(self) -> dict[str, object]:
        return {HELPER: ThreadPatches()}

    def _install_state(self, module: types.ModuleType, source: str) -> None:
        super()._install_state(module, source)
        skip_in_dynamo_when_imported()


def _probe() -> str | None:
    module = sys.modules.get(MODULE) or __import__(MODULE, fromlist=["_"])
    if HELPER in vars(module):
        return "FX tracing patches are per-thread already"
    if not hasattr(module, "_Patcher"):
        return f"{MODULE} has no _Patcher (FX patches torch differently in this release)"
    return None


def _module_slots() -> dict[str, object]:
    """What ``Tracer.trace`` patches on ``nn.Module``: must be the originals again once no trace runs."""
    import torch

    return {name: vars(torch.nn.Module)[name] for name in ("__call__", "__getattr__")}


def h4_trace_patches_leak(action: str, timeout: float = 60.0) -> Result | None:
    """H4: thread A holds a ``symbolic_trace`` of a module open while the main thread does ``action``:

    * ``eager_module``: calls a module eagerly (without the fix it runs A's patched ``Module.__call__``);
    * ``symbolic_trace``: a third thread starts its own trace, held open until A has finished (they overlap
      without nesting: without the fix A reverts B's patcher, B finds ``CURRENT_PATCHER`` None);
    * ``cond``: runs ``torch.cond`` eagerly (it compiles its branches with Dynamo).

    The hazard shows as an error in either thread, a wrong graph, or ``nn.Module`` left patched.
    None for ``cond`` where torch has no ``torch.cond``.
    """
    import torch

    if action == "cond" and not hasattr(torch, "cond"):
        return None
    slots = _module_slots()
    errors: list[str] = []
    graphs: list[list[str]] = []
    held = HeldTrace("symbolic_trace_module", timeout).__enter__()
    other: HeldTrace | None = None
    try:
        if action == "eager_module":
            torch.nn.Linear(2, 2)(torch.ones(2))
        elif action == "symbolic_trace":
            other = HeldTrace("symbolic_trace_module", timeout).__enter__()
        else:
            torch.cond(torch.tensor(True), lambda x: x.sin(), lambda x: x.cos(), (torch.ones(2),))  # 2.2: no builtins
    except Exception as exc:
        errors.append(f"main thread: {exc!r}")
    for trace in (held, other):  # A finishes first
        if trace is not None:
            trace.__exit__(RuntimeError, None, None)  # errors are collected here, not raised
            errors += [f"{trace.thread.name}: {exc!r}" for exc in trace.errors]
            graphs.append(trace.graph_ops)
    wrong = [ops for ops in graphs if ops != MODULE_GRAPH]
    leaked = [name for name, value in _module_slots().items() if value is not slots[name]]
    problems = errors + [f"wrong graph {ops}" for ops in wrong] + [f"nn.Module.{name} left patched" for name in leaked]
    return Result(f"H4 ({action} in one thread while another traces)", bool(problems), "; ".join(problems) or "ok")


def concurrent_tracers(threads: int = 4, rounds: int = 5, timeout: float = 60.0) -> Result:
    """H4 under load: ``threads`` threads ``symbolic_trace`` a module at once, every round; a barrier inside
    the traced code makes all of them be inside their traces together, and they finish in any order.
    """
    slots = _module_slots()
    barrier = threading.Barrier(threads, timeout=timeout)
    problems: list[str] = []

    def in_every_trace(x):
        barrier.wait()
        return x + 1

    def tracer() -> None:
        for _ in range(rounds):
            try:
                ops = graph_ops(module_around(in_every_trace))
                if ops != MODULE_GRAPH:
                    problems.append(f"wrong graph {ops}")
            except threading.BrokenBarrierError:
                return  # another thread failed first and broke the barrier; its error is recorded
            except Exception as exc:
                problems.append(repr(exc))
                barrier.abort()
                return

    workers = [threading.Thread(target=tracer, name=f"tracer-{i}", daemon=True) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout)
    if any(worker.is_alive() for worker in workers):
        raise TimeoutError("a tracer thread did not finish")
    problems += [
        f"nn.Module.{name} left patched" for name, value in _module_slots().items() if value is not slots[name]
    ]
    traces = threads * rounds
    detail = f"{len(problems)} problem(s): {'; '.join(problems[:3])}" if problems else f"all {traces} traces correct"
    return Result(f"H4 x{traces} ({threads} threads tracing at once, {rounds} rounds)", bool(problems), detail)


def soak_symbolic_trace() -> Callable[[random.Random], None]:
    """The soak's ``symbolic_trace``: a module around a function; another thread's patches make another graph."""
    add_one = fresh_add_one()

    def trace(rng: random.Random) -> None:
        ops = graph_ops(module_around(add_one))
        assert ops == MODULE_GRAPH, f"traced graph {ops}"

    return trace


def soak_eager_module() -> Callable[[random.Random], None]:
    """The soak's ``eager module``: a module called eagerly, which a tracer's patch in another thread takes over."""
    import torch

    module = torch.nn.Linear(3, 3)

    def call(rng: random.Random) -> None:
        x = torch.ones(1, 3)
        with torch.no_grad():
            want = x @ module.weight.T + module.bias
            assert torch.allclose(module(x), want), "an eager module gave a wrong result"

    return call


def soak_leak_probe() -> Callable[[bool], bool]:
    """Whether an eager module misbehaves in the calling thread (a tracer's patch on it); at the end also whether
    ``nn.Module``'s slots are not what they were before the soak."""
    import torch

    slots = _module_slots()
    probe, probe_input = torch.nn.Linear(2, 2), torch.ones(1, 2)
    with torch.no_grad():
        probe_output = probe(probe_input)

    def misbehaves() -> bool:
        try:
            with torch.no_grad():
                return not torch.equal(probe(probe_input), probe_output)
        except Exception:
            return True

    return lambda at_end: misbehaves() or (at_end and _module_slots() != slots)


FIX = Fix(
    name="trace-patch-isolation",
    order=30,
    hazard="an FX trace in one thread patches nn.Module.__call__/__getattr__ and wrapped functions for every thread",
    versions=releases("2.0"),
    probe=_probe,
    patches=lambda _torch_version: [_IsolationPatch()],
    scenarios=(
        Scenario(h4_trace_patches_leak, releases("2.0"), args=("eager_module",)),
        Scenario(h4_trace_patches_leak, releases("2.0"), args=("cond",), needs="torch.cond", stage=1),
        Scenario(h4_trace_patches_leak, releases("2.0"), args=("symbolic_trace",), stage=1),
    ),
    shared_state=(
        "H4: `Tracer.trace` patches `nn.Module.__call__`/`__getattr__` and wrapped functions process-wide; "
        "`CURRENT_PATCHER` is a global"
    ),
    symptom=(
        "eager modules in other threads run the tracer's wrappers (`NameError: module is not installed as a "
        "submodule`), overlapping traces corrupt each other (`AssertionError: CURRENT_PATCHER is None in finally "
        "block`)"
    ),
    soak=SoakCheck(
        errors=("is not installed as a submodule", "CURRENT_PATCHER", "traced graph", "an eager module"),
        actions=(
            SoakAction("symbolic_trace", 3, soak_symbolic_trace),
            SoakAction("eager module", 4, soak_eager_module),
        ),
        leak_probe=soak_leak_probe,
    ),
    survey_rows=(
        "torch/fx/_symbolic_trace.py: CURRENT_PATCHER",
        "torch/fx/_symbolic_trace.py: nn.Module.__call__/__getattr__ and autowrapped fns",
    ),
)
