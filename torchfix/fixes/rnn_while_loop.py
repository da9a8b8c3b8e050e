"""export-rnn-while-loop: the while_loop LSTM / GRU decomposition is the entering thread's own.

``torch.export._patches.register_lstm_while_loop_decomposition()`` and ``register_gru_while_loop_decomposition()``
(torch 2.11+; every ``torch.onnx.export(..., dynamo=True)`` with dynamic shapes enters both) run
``_register_rnn_while_loop_decomposition``: it writes the op's (``aten.lstm.input``, ``aten.gru.input``)
``py_kernels[CompositeImplicitAutograd]`` and ``torch._decomp.global_decomposition_table["post_autograd"][op]``
for the whole process, and puts the values it saved back in its ``finally``. Meanwhile (2.13, 2.14.1, 2.15, with
events): another thread's ``run_decompositions()`` of an LSTM program builds its table
(``torch.export.default_decompositions()``, which reads the op's CompositeImplicitAutograd kernel) with the
while_loop kernel: on 2.14.1 and 2.15 an untrainable ``while_loop`` graph, on 2.13 ``SpecViolationError``; and two
threads inside, the first in leaving first, leave the kernel and the table entry installed for good (the second
saved the first's), for every later ``run_decompositions()`` in the process.

The op's kernels go through :mod:`torchfix.patching.kernels`, the mechanism of ``export-decomp-kernels``: on entry
the thread gets its own copy of the op's ``py_kernels``, which torch's code edits and restores as before; other
threads see the op's real table; after the thread's restore it drops its copy. Torch writes these kernels without
clearing the op's dispatch cache (``op._dispatch_cache``), so the cache stays in place (``cached=True``), as torch
keeps it: one thread's behaviour is torch's, handler by handler.

The decomposition table entry is counted (one dict that torch and users read directly, by identity:
``torch._decomp.decomposition_table`` is the same object): the first thread in saves the entry and every thread
in writes the while_loop function, as torch does; the last one out puts the first one's saved value back (or
removes the entry, as torch does where there was none). It is never left installed, and a thread inside keeps it
until it leaves.

What stays process-wide (as in torch): while some thread is inside, other threads that read
``global_decomposition_table["post_autograd"]`` itself (``get_decompositions([aten.lstm])``, a table copied
whole) get the while_loop function; ``torch.export.default_decompositions()`` does not read that entry. And the
dispatch cache: a handler the Python dispatcher resolves for the op inside the context (the while_loop kernel,
where no trace of an LSTM had filled the cache before) is cached for every thread and stays after the context, as
it does in one thread; a handler cached before (torch's LSTM kernel, after any trace of an LSTM) keeps serving the
entering thread too.

The per-thread tables follow a thread into autograd's device thread (torch 2.13+); while_loop has no autograd, and
a backward reaches these kernels only through a trace made inside.
"""

from __future__ import annotations

import ast
import importlib.util
import threading
from collections import Counter

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result
from ..patching import kernels
from ..patching.patches import SourcePatch
from ..patching.source import Edit, ShapeError, definition, find_replaced, insert_at, replace_node, segment

MODULE = "torch.export._patches"
RELPATH = "torch/export/_patches.py"
FUNCTION = "_register_rnn_while_loop_decomposition"
HELPER = "_torchfix_rnn_while_loop"


class RnnDecompositions:
    """What the edited context calls: the op's kernels through :mod:`torchfix.patching.kernels` (with its cache
    kept), and the decomposition table's entry for the op counted over the threads inside."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: Counter = Counter()  # op -> the contexts inside, in all threads
        self._saved: dict[object, object] = {}  # op -> the entry the first one in found

    def enter(self, op: object) -> None:
        kernels.shared().enter(op, cached=True)

    def leave(self, op: object) -> None:
        kernels.shared().leave(op, cached=True)

    def hold(self, registry: dict, op: object, impl: object) -> None:
        """``registry[op] = impl``, the first holder saving what was there."""
        with self._lock:
            if not self._holders[op]:
                self._saved[op] = registry.get(op)
            self._holders[op] += 1
            registry[op] = impl

    def release(self, registry: dict, op: object) -> None:
        """The last holder out puts the first one's saved entry back (torch's restore: none saved, none put)."""
        with self._lock:
            self._holders[op] -= 1
            if self._holders[op]:
                return
            del self._holders[op]
            saved = self._saved.pop(op)
            if saved is not None:
                registry[op] = saved
            else:
                registry.pop(op, None)


class _OwnDecomposition(SourcePatch):
    """``_register_rnn_while_loop_decomposition`` through :class:`RnnDecompositions`: ``enter`` before its first
    statement, ``hold`` for its table write, ``release`` for both branches of its table restore, ``leave`` after
    both branches of its kernel restore."""

    def __init__(self) -> None:
        super().__init__(MODULE, RELPATH)

    def describe(self) -> str:
        return super().describe() + f"; adds {HELPER} (the thread's own kernels, the table entry counted)"

    def edits(self, source: str) -> list[Edit]:
        function = definition(source, self.relpath, FUNCTION)
        op, impl = (arg.arg for arg in function.args.args[:2])
        first = function.body[1] if ast.get_docstring(function) is not None else function.body[0]
        (tried,) = find_replaced(self.relpath, function, "try/finally", lambda n: isinstance(n, ast.Try))
        (write,) = find_replaced(
            self.relpath, tried.body, f"registry[{op}] = {impl}", lambda n: _assigns(source, n, f"registry[{op}]")
        )
        restores = find_replaced(
            self.relpath,
            tried.finalbody,
            "restore of the table entry",
            lambda n: (
                _assigns(source, n, f"registry[{op}]")
                or (isinstance(n, ast.Expr) and segment(source, n) == f"registry.pop({op}, None)")
            ),
            count=2,
        )
        kernel_restore = tried.finalbody[-1]
        if not isinstance(kernel_restore, ast.If) or f"{op}.py_kernels" not in segment(source, kernel_restore):
            raise ShapeError(f"{self.relpath}: {FUNCTION}'s finally does not end with the kernel's restore")
        leave, branches = f"; {HELPER}.leave({op})", (kernel_restore.body, kernel_restore.orelse)
        return [
            insert_at(first.lineno, first.col_offset, f"{HELPER}.enter({op}); "),
            replace_node(write, f"{HELPER}.hold(registry, {op}, {impl})"),
            *(replace_node(node, f"{HELPER}.release(registry, {op})") for node in restores),
            *(insert_at(b[-1].end_lineno, b[-1].end_col_offset, leave) for b in branches),
        ]

    def helpers(self) -> dict[str, object]:
        return {HELPER: RnnDecompositions()}


def _assigns(source: str, node: ast.AST, target: str) -> bool:
    return isinstance(node, ast.Assign) and [segment(source, t) for t in node.targets] == [target]


def _probe() -> str | None:
    if importlib.util.find_spec(MODULE) is None:
        return f"torch has no {MODULE} (before 2.11): no while_loop RNN decomposition"
    return None


def _names() -> dict[str, str]:
    """What the calling thread sees of ``aten.lstm.input``: its CompositeImplicitAutograd kernel and its entry in
    the post-autograd decomposition table, by function name."""
    import torch
    from torch._decomp import global_decomposition_table

    op = torch.ops.aten.lstm.input
    kernel = op.py_kernels.get(torch._C.DispatchKey.CompositeImplicitAutograd)
    entry = global_decomposition_table["post_autograd"].get(op)
    return {"kernel": getattr(kernel, "__name__", str(kernel)), "table": getattr(entry, "__name__", str(entry))}


def while_loop_elsewhere(timeout: float = 60.0) -> Result | None:
    """Thread A enters ``register_lstm_while_loop_decomposition()`` and waits inside; the main thread builds
    ``torch.export.default_decompositions()`` (what ``run_decompositions()`` decomposes with): its LSTM entry must be
    torch's own. Thread B enters too; A leaves first, and B must still see the while_loop kernel; B leaves. After,
    the op's kernel and table entry must be torch's. None before torch 2.11 (no such context)."""
    if importlib.util.find_spec(MODULE) is None:
        return None
    import torch
    from torch.export._patches import register_lstm_while_loop_decomposition

    op = torch.ops.aten.lstm.input
    before = _names()
    inside = {name: threading.Event() for name in "AB"}
    leave = {name: threading.Event() for name in "AB"}
    seen: dict[str, object] = {}

    def hold(name: str) -> None:
        try:
            with register_lstm_while_loop_decomposition():
                seen[f"{name} inside"] = _names()
                inside[name].set()
                leave[name].wait(timeout)
                seen[f"{name} at its end"] = _names()
        finally:
            inside[name].set()

    threads = {name: threading.Thread(target=hold, args=(name,), name=f"torchfix-selftest-{name}") for name in "AB"}
    threads["A"].start()
    inside["A"].wait(timeout)
    table = torch.export.default_decompositions()
    seen["the main thread's default_decompositions()"] = getattr(table[op], "__name__", str(table[op]))
    threads["B"].start()
    inside["B"].wait(timeout)
    leave["A"].set()
    threads["A"].join(timeout)
    leave["B"].set()
    threads["B"].join(timeout)
    seen["after"] = _names()
    own = {"kernel": "lstm_while_loop_impl", "table": "lstm_while_loop_impl"}
    hazard = (
        seen["the main thread's default_decompositions()"] != before["kernel"]
        or seen["after"] != before
        or any(seen.get(f"{name} {when}") != own for name in "AB" for when in ("inside", "at its end"))
    )
    detail = "; ".join(f"{where}: {value}" for where, value in seen.items())
    scenario = "while_loop LSTM decomposition in other threads (a decomposition meanwhile, overlapping)"
    return Result(scenario, hazard, detail)


FIX = Fix(
    name="export-rnn-while-loop",
    order=398,
    hazard="register_lstm/gru_while_loop_decomposition() installs the while_loop kernel for every thread: another "
    "thread's run_decompositions() takes it; two overlapping contexts leave it installed for good",
    versions=releases("2.11"),
    probe=_probe,
    patches=lambda _torch_version: [_OwnDecomposition()],
    trigger=MODULE,
    scenarios=(
        Scenario(
            while_loop_elsewhere,
            releases("2.11"),
            needs=f"{MODULE} (2.11+)",
            shows="the main thread's default_decompositions(): lstm_while_loop_impl",
            stage=1,  # without the fix it leaves the while_loop kernel installed for the process
        ),
    ),
    shared_state="aten.lstm.input / aten.gru.input .py_kernels[CompositeImplicitAutograd] and "
    'torch._decomp.global_decomposition_table["post_autograd"][op]: written by _register_rnn_while_loop_decomposition '
    "(register_lstm_while_loop_decomposition, register_gru_while_loop_decomposition; torch.onnx.export(dynamo=True) "
    "with dynamic shapes), read by default_decompositions() / run_decompositions() of every thread; the table entry "
    "stays process-wide, counted; the op's dispatch cache stays torch's",
    symptom="another thread's run_decompositions() of an LSTM program decomposes with the while_loop kernel "
    "(2.14.1, 2.15: an untrainable while_loop graph; 2.13: SpecViolationError); two overlapping contexts, the first "
    "in leaving first, leave the kernel and the table entry installed for good (2.13, 2.14.1, 2.15); its scenario: "
    "3 of 3 runs on 2.13 and 2.15 and 2 of 2 on 2.14.1 without the fix, none with it",
    releases_note='before 2.11: "not needed" (no such context); 2.11 - 2.15 the same function, word for word',
    caveats="while a thread is inside, other threads that read the post-autograd decomposition table itself "
    "(get_decompositions([aten.lstm])) get the while_loop function, as in torch; a handler the Python dispatcher "
    "caches for the op inside the context serves every thread, after it too, as torch caches it",
    survey_rows=(
        "torch/export/_patches.py: aten.lstm/gru py_kernels[CompositeImplicitAutograd] and "
        'global_decomposition_table["post_autograd"]',
    ),
)
