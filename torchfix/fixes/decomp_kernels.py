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

While any thread is inside, each op it overrides gets a table that answers every thread with its own kernels
(:mod:`torchfix.patching.kernels`, shared with ``export-rnn-while-loop``): ``op.py_kernels`` becomes a view of the
calling thread's own copy, which torch's code edits and restores as before, or of the op's real table for any
other thread; ``op._dispatch_cache`` becomes a dict that keeps nothing. Torch's C++ dispatcher reads that dict
itself, not through Python, so an entry would serve every thread alike; empty, it asks ``op._get_dispatch`` each
time, which resolves against the calling thread's table. When the last thread is out, the op gets its own table
and cache back (the cache cleared, as torch leaves it) and torch's fake rule is dropped. The setup loops of two
threads take turns under one lock (torch checks, then registers, each op's fake rule).

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

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result, fresh, torch_module
from ..patching import kernels
from ..patching.patches import SourcePatch
from ..patching.source import Edit, ShapeError, definition, replace_node, segment

MODULE = "torch.export.exported_program"
RELPATH = "torch/export/exported_program.py"
FUNCTION = "_override_composite_implicit_decomp"
HELPER = "_torchfix_decomp_kernels"


class _ThreadOverrides(SourcePatch):
    """``_override_composite_implicit_decomp`` through :func:`torchfix.patching.kernels.shared`: its setup loop runs
    under the lock and saves what ``enter`` returns; the last statement of its restore loop becomes ``leave`` (which
    then runs it, on 2.6+ where it drops the fake rule, after the last uncached override is out)."""

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
        return {HELPER: kernels.shared()}


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
    survey_rows=(
        "torch/export/exported_program.py: OpOverload.py_kernels of the CompositeImplicitAutograd ops",
        "torch/_ops.py: OpOverload._dispatch_cache",
        "torch/_subclasses/fake_impls.py: op_implementations_dict / op_implementations_checks",
    ),
)
