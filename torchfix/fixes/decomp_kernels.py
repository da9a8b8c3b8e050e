"""export-decomp-kernels: the operator overrides of ``run_decompositions()`` are the decomposing thread's own.

``ExportedProgram.run_decompositions()`` (torch 2.5+) traces the program inside
``torch.export.exported_program._override_composite_implicit_decomp``, which rewrites the Python-dispatcher kernels
(``OpOverload.py_kernels``) of the operators it preserves or decomposes its own way: from 2.6 every
CompositeImplicitAutograd operator (526 in one call on 2.13, ``aten.linear`` among them), whatever the table; in 2.5
the variants of ``aten.to`` and the ops a caller preserves. It registers ``autograd_not_implemented(op,
deferred_error=True)`` to the autograd keys, its own kernel to CompositeImplicitAutograd and the original
decomposition to the backend keys, and (2.6+) a fake-tensor rule for the op; at its end it puts a saved copy of each
table back, clears the op's ``_dispatch_cache`` and (2.6+) drops the fake rule. All of it is process-wide, so
meanwhile (seen on 2.13.0 and 2.14.1; this fix's scenario shows it on 2.10, 2.13 and 2.15 with torchfix's other
fixes on):

* another thread's ``torch.compile`` training step traces its joint graph (AOTAutograd runs on the Python
  dispatcher) through those kernels: no gradient flows through ``linear``, ``weight.grad`` is None after
  ``backward()``, with no error; the compiled graph stays cached after the decomposition ends;
* two overlapping calls, the first to start ending first, leave the overrides installed for good (the second
  saved the first's tables): every later training compile in the process silently loses those gradients; and the
  second, still tracing, loses its own overrides and fake rules when the first ends.

While any thread is inside, each op it overrides gets a table that answers every thread with its own kernels:
``op.py_kernels`` becomes a view (:class:`_ThreadKernels`) of the calling thread's own copy, which torch's code
edits and restores as before, or of the op's real table for any other thread; ``op._dispatch_cache`` becomes a
dict that keeps nothing (:class:`_Uncached`). Torch's C++ dispatcher reads that dict itself, not through Python,
so an entry would serve every thread alike; empty, it asks ``op._get_dispatch`` each time, which resolves against
the calling thread's table. When the last thread is out, the op gets its own table and cache back (the cache
cleared, as torch leaves it) and torch's fake rule is dropped. The setup loops of two threads take turns under one
lock (torch checks, then registers, each op's fake rule).

The per-thread tables live in :class:`ThreadSpaces`, which follow a thread into autograd's device thread. Torch's own
joint decomposition (``torch.export.experimental._export_forward_backward``, whose backward is traced there for CUDA
tensors) overrides no op (``cia_to_decomp={}``; 2.5: no op preserved), so no backward runs under the overrides
today; a caller of ``_decompose_exported_program`` with a joint loss and overrides gets torch's behaviour there too
(2.13+; before, ``ThreadSpaces`` cannot follow, and such a backward would see torch's own tables).

What stays process-wide: the fake rules, registered while any thread is inside (they run the op's original
decomposition under fake mode, what fake tensors do for such an op anyway, and CompositeImplicitAutograd ops seldom
reach fake tensors: the dispatcher decomposes them above). A setup loop that torch aborts with an error (2.5: an op
that cannot be preserved) leaves the ops it had entered with the thread's own tables for good, uncached; torch
leaves them overridden for every thread.
"""

from __future__ import annotations

import ast
import importlib
import threading
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from dataclasses import dataclass

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result, fresh, torch_module
from ..patching.patches import SourcePatch
from ..patching.source import Edit, ShapeError, definition, replace_node, segment
from ..patching.stash import ThreadSpaces

MODULE = "torch.export.exported_program"
RELPATH = "torch/export/exported_program.py"
FUNCTION = "_override_composite_implicit_decomp"
HELPER = "_torchfix_decomp_kernels"


class _Uncached(dict):
    """``op._dispatch_cache`` while some thread has its own kernels for the op: empty for good, so that torch's C++
    dispatcher, which looks handlers up in the dict itself, always asks ``op._get_dispatch``."""

    def __setitem__(self, key: object, value: object) -> None:
        pass


@dataclass
class _Own:
    table: dict  # the thread's copy of the op's py_kernels, which torch's code edits
    depth: int = 0  # the thread's overrides of the op under way (they nest: torch 2.5 - 2.7 enter two at once)


class _ThreadKernels(MutableMapping):
    """``op.py_kernels`` while some thread has its own kernels for the op: the calling thread's table where it has
    one (on autograd's device thread, the table of the thread whose backward it runs), the op's real one otherwise."""

    def __init__(self, op: object, shared: dict, overrides: DecompKernels) -> None:
        self._op, self._shared, self._overrides = op, shared, overrides

    def _table(self) -> dict:
        own = self._overrides.own(self._op)
        return self._shared if own is None else own.table

    def __getitem__(self, key: object) -> object:
        return self._table()[key]

    def __setitem__(self, key: object, value: object) -> None:
        self._table()[key] = value

    def __delitem__(self, key: object) -> None:
        del self._table()[key]

    def __contains__(self, key: object) -> bool:
        return key in self._table()

    def __iter__(self) -> Iterator:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())

    def get(self, key: object, default: object = None) -> object:
        return self._table().get(key, default)

    def copy(self) -> dict:
        return self._table().copy()

    def clear(self) -> None:
        self._table().clear()

    def __repr__(self) -> str:
        return repr(self._table())


class DecompKernels:
    """The ops that threads override while they decompose, and each thread's own kernel tables for them."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._threads = ThreadSpaces("decomp-kernels", seen_in_backward=True)
        self._real: dict[object, tuple[dict, dict]] = {}  # op -> its own py_kernels and _dispatch_cache, set aside
        self._inside: dict[object, int] = {}  # op -> the overrides of it under way, in all threads

    def own(self, op: object) -> _Own | None:
        tables = self._tables()
        return None if tables is None else tables.get(op)

    def _tables(self) -> dict[object, _Own] | None:
        """The calling thread's own tables, by op; None where it has overridden nothing."""
        return getattr(self._threads.get(), "tables", None)

    def locked(self, items: Iterable) -> Iterator:
        """The items of torch's setup loop, with the lock held while it runs: two threads' setups take turns."""
        with self._lock:
            yield from items

    def enter(self, op: object) -> dict:
        """The calling thread starts overriding ``op``: returns a copy of its table, what torch saves to restore."""
        with self._lock:
            if op not in self._real:
                self._real[op] = (op.py_kernels, op._dispatch_cache)
                op.py_kernels, op._dispatch_cache = _ThreadKernels(op, op.py_kernels, self), _Uncached()
            tables = vars(self._threads.make()).setdefault("tables", {})
            own = tables.get(op)
            if own is None:
                own = tables[op] = _Own(dict(self._real[op][0]))
            own.depth += 1
            self._inside[op] = self._inside.get(op, 0) + 1
            return own.table.copy()

    def leave(self, op: object, last_out: Callable[[object], None] | None = None) -> None:
        """The calling thread ends an override of ``op`` (torch has restored its table). After the last thread's,
        the op gets its own table and its cache back, cleared as torch leaves it, and ``last_out(op)`` runs (torch's
        removal of the fake rule)."""
        with self._lock:
            tables = self._tables()
            tables[op].depth -= 1
            if tables[op].depth == 0:
                del tables[op]
            self._inside[op] -= 1
            if self._inside[op]:
                return
            del self._inside[op]
            kernels, cache = self._real.pop(op)
            op.py_kernels, op._dispatch_cache = kernels, cache
            cache.clear()
            if last_out is not None:
                last_out(op)


class _ThreadOverrides(SourcePatch):
    """``_override_composite_implicit_decomp`` through :class:`DecompKernels`: its setup loop runs under the lock and
    saves what ``enter`` returns; the last statement of its restore loop becomes ``leave`` (which then runs it, on
    2.6+ where it drops the fake rule, after the last thread is out)."""

    def __init__(self) -> None:
        super().__init__(MODULE, RELPATH)

    def describe(self) -> str:
        return super().describe() + f"; adds {HELPER} (each thread's own py_kernels of the ops it overrides)"

    def edits(self, source: str) -> list[Edit]:
        function = definition(source, self.relpath, FUNCTION)
        setup = [loop for loop in function.body if isinstance(loop, ast.For) and self._saved_copy(source, loop)]
        tries = [node for node in function.body if isinstance(node, ast.Try)]
        if len(setup) != 1 or len(tries) != 1 or not isinstance(tries[0].finalbody[0], ast.For):
            raise ShapeError(f"{self.relpath}: {FUNCTION} is not one setup loop, then try/finally with a restore loop")
        restore = tries[0].finalbody[0]
        op, last = segment(source, restore.target), restore.body[-1]
        leave = {
            f"_deregister_op_impl({op})": f"{HELPER}.leave({op}, _deregister_op_impl)",  # 2.6+
            f"{op}._dispatch_cache.clear()": f"{HELPER}.leave({op})",  # 2.5
        }.get(segment(source, last))
        if leave is None:
            raise ShapeError(f"{self.relpath}: {FUNCTION}'s restore loop does not end as expected")
        copy = self._saved_copy(source, setup[0])
        return [
            replace_node(setup[0].iter, f"{HELPER}.locked({segment(source, setup[0].iter)})"),
            replace_node(copy, f"{HELPER}.enter({segment(source, copy.func.value.value)})"),
            replace_node(last, leave),
        ]

    @staticmethod
    def _saved_copy(source: str, loop: ast.For) -> ast.Call | None:
        """The ``op.py_kernels.copy()`` whose value the setup loop saves, if ``loop`` is the setup loop."""
        copies = [
            node.value
            for node in ast.walk(loop)
            if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and segment(source, node.value).endswith(".py_kernels.copy()")
            and isinstance(node.value.func.value, ast.Attribute)
        ]
        return copies[0] if len(copies) == 1 else None

    def helpers(self) -> dict[str, object]:
        return {HELPER: DecompKernels()}


def _probe() -> str | None:
    if not hasattr(importlib.import_module(MODULE), FUNCTION):
        return f"{MODULE} has no {FUNCTION} (before torch 2.5): decompositions leave operators' kernels alone"
    return None


def _held_decompositions(reached: threading.Event, release: threading.Event, timeout: float, seen: dict) -> object:
    """The default decomposition table, plus one for ``aten.sin`` that holds the trace where every override is in:
    it says so, records what the thread sees of ``aten.linear``'s kernels, waits for ``release``, records again, and
    lets the op be traced as usual."""
    import torch

    table = torch.export.default_decompositions()

    def hold(*args: object, **kwargs: object) -> object:
        if not reached.is_set():
            seen["own overrides"] = _overridden()
            reached.set()
            release.wait(timeout)
            seen["own overrides still"] = _overridden()
        return NotImplemented

    table[torch.ops.aten.sin.default] = hold
    return table


def _overridden() -> bool:
    import torch

    return torch._C.DispatchKey.AutogradCPU in torch.ops.aten.linear.default.py_kernels


def _train_step() -> str | None:
    """A compiled training step of a fresh ``nn.Linear``: None if its gradients equal eager's, else what differs."""
    import torch

    torch.manual_seed(0)
    model, x = torch.nn.Linear(3, 2), torch.randn(4, 3)
    model(x).sum().backward()
    eager = model.weight.grad.clone()
    model.weight.grad = None
    torch.compile(fresh(_loss), backend="aot_eager")(model, x).backward()
    if model.weight.grad is None:
        return "weight.grad is None"
    return None if torch.allclose(model.weight.grad, eager) else "weight.grad differs from eager's"


def _loss(model: object, x: object) -> object:
    return model(x).sum()


def decompositions_elsewhere(timeout: float = 120.0) -> Result | None:
    """Thread A runs ``run_decompositions()`` and waits inside (every override in); the main thread compiles and runs
    a training step of an ``nn.Linear``; thread B starts another ``run_decompositions()`` and waits inside; A ends, and
    B still sees its own overrides; B ends. Afterwards ``aten.linear``'s kernels must be torch's and a training step
    compiled then must get eager's gradients too. None before torch 2.6 (no table of CompositeImplicitAutograd ops)."""
    import torch

    exported = torch_module(MODULE)
    if exported is None or not hasattr(exported, "_split_decomp_table_to_cia_and_python_decomp"):
        return None

    class Sin(torch.nn.Module):
        def forward(self, x):
            return x.sin() + 1

    program = torch.export.export(Sin(), (torch.ones(2),))
    linear = torch.ops.aten.linear.default
    before = dict(linear.py_kernels)
    views = {"A": {}, "B": {}}
    reached = {name: threading.Event() for name in views}
    release = {name: threading.Event() for name in views}
    errors: list[str] = []

    def decompose(name: str) -> None:
        try:
            program.run_decompositions(_held_decompositions(reached[name], release[name], timeout, views[name]))
        except Exception as exc:
            errors.append(f"{name} raised {type(exc).__name__}: {exc}")
        finally:
            reached[name].set()

    a = threading.Thread(target=decompose, args=("A",), name="torchfix-selftest-A", daemon=True)
    b = threading.Thread(target=decompose, args=("B",), name="torchfix-selftest-B", daemon=True)
    a.start()
    reached["A"].wait(timeout)
    during = _train_step()
    b.start()
    reached["B"].wait(timeout)
    release["A"].set()
    a.join(timeout)
    release["B"].set()
    b.join(timeout)
    left = sorted(str(key) for key in linear.py_kernels if key not in before)
    after = _train_step()
    problems = [f"compiled meanwhile: {during}"] if during else []
    if left:
        problems.append(f"left installed: {len(left)} kernels of aten.linear ({left[0]}, ...)")
    if after:
        problems.append(f"compiled after: {after}")
    problems += [f"{name} did not see its own overrides" for name, seen in views.items() if not all(seen.values())]
    problems += errors
    detail = "; ".join(problems) or "gradients equal eager's, during and after; each thread saw its own overrides"
    scenario = "run_decompositions in other threads (a training compile meanwhile, overlapping calls)"
    return Result(scenario, bool(problems), detail)


FIX = Fix(
    name="export-decomp-kernels",
    order=397,
    hazard="run_decompositions() installs operator overrides for every thread: a training step compiled meanwhile "
    "gets no gradient through linear; overlapping calls leave them installed for good",
    versions=releases("2.5"),
    probe=_probe,
    patches=lambda _torch_version: [_ThreadOverrides()],
    trigger=MODULE,
    scenarios=(
        Scenario(
            decompositions_elsewhere,
            releases("2.6"),
            needs="run_decompositions with a table of CompositeImplicitAutograd ops (2.6+)",
            shows="compiled meanwhile: weight.grad is None",
            stage=1,  # without the fix it leaves every later training compile without gradients
        ),
    ),
    shared_state="OpOverload.py_kernels and OpOverload._dispatch_cache of the ~525 CompositeImplicitAutograd ops "
    "(2.5: aten.to's variants and the ops preserved), and fake_impls.op_implementations_dict (2.6+): written by "
    "_override_composite_implicit_decomp (ExportedProgram.run_decompositions), read by the Python dispatcher of "
    "every thread (AOTAutograd, make_fx, export); the fake rules stay process-wide, counted",
    symptom="a torch.compile training step compiled in another thread meanwhile: weight.grad None after backward(), "
    "no error, the graph kept (2.10, 2.13, 2.15: every scenario run, 7 of 7); after two overlapping calls every later "
    "training compile loses those gradients; three threads decomposing at once, no events: RuntimeError 'Trying to "
    "override a python impl for DispatchKey...', graphs unlike one thread's, gradients lost (2.13, 3 of 3 runs)",
    releases_note='before 2.5: "not needed" (no such override); 2.5 overrides only aten.to\'s variants and the ops '
    "a caller preserves, and has no scenario (not measured); 2.6 - 2.15 the same function, 2.8+ word for word",
)
