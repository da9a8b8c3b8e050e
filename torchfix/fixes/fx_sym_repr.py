"""fx-sym-repr: ``print_readable(fast_sympy_print=True)``'s symbol printer acts only in the printing thread.

``torch.fx.graph._override_sym_repr(printer)`` (torch 2.8+), entered by ``GraphModule.print_readable(...,
fast_sympy_print=True)`` (AOTAutograd's cache key, inductor's post-grad artifact), writes ``printer`` over the
class attribute ``CodeGen._sym_repr``, process-wide, and puts back what it found in ``finally``. While it prints,
every other thread's readable code (``print_readable``, graph logs) annotates its symbols with that printer; two
threads inside it that leave out of order leave the second one's printer on the class for good (reproduced on 2.13,
2.14.1 and 2.15). Only readable printouts use it: the code a GraphModule runs has no ``Sym(`` annotations.

Its write, restore and read of the slot go through ``torch.fx.graph._thread_patches``, a ``ThreadPatches``
(``patching/slots.py``): the printer is the calling thread's, and the class's own comes back once no thread holds one.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result
from ..patching.patches import source_without_import
from ..patching.slots import HELPER, SlotPatches

MODULE, FUNCTION = "torch.fx.graph", "_override_sym_repr"


def _probe() -> str | None:
    if f"def {FUNCTION}(" not in (source_without_import(MODULE) or ""):
        return f"{MODULE} has no {FUNCTION} (before 2.8)"
    if HELPER in vars(importlib.import_module(MODULE)):
        return "the symbol printer's patches are per thread already"
    return None


class _HeldPrinter:
    """A thread inside ``_override_sym_repr(printer)`` until :meth:`leave`, ``printer`` naming it ``Sym(<name>)``."""

    def __init__(self, name: str, timeout: float) -> None:
        graph = importlib.import_module(MODULE)
        self.timeout, inside, self.release = timeout, threading.Event(), threading.Event()

        def hold() -> None:
            with graph._override_sym_repr(lambda _sym: name):
                inside.set()
                self.release.wait(timeout)

        self.thread = threading.Thread(target=hold, name="torchfix-selftest", daemon=True)
        self.thread.start()
        inside.wait(timeout)

    def leave(self) -> None:
        self.release.set()
        self.thread.join(self.timeout)


def _symbolic_graph() -> Callable[[], str]:
    """The readable code of a graph with a symbolic size (its annotations name ``Sym(s...)``), as a function."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    traced = make_fx(lambda x: x * x.shape[0], tracing_mode="symbolic")(torch.ones(3))
    return lambda: traced.print_readable(print_output=False)


def sym_printer_elsewhere(timeout: float = 60.0) -> Result | None:
    """While thread A is inside ``_override_sym_repr`` with its printer, the main thread's ``print_readable()`` must
    not show A's printer; then A and B enter in turn and A leaves first: ``CodeGen._sym_repr`` must be the class's
    own again. None before 2.8 (no ``_override_sym_repr``)."""
    if f"def {FUNCTION}(" not in (source_without_import(MODULE) or ""):
        return None
    graph = importlib.import_module(MODULE)
    readable, own, problems = _symbolic_graph(), vars(graph.CodeGen)["_sym_repr"], []
    a = _HeldPrinter("printer-of-A", timeout)
    if "printer-of-A" in readable():
        problems.append("the main thread's print_readable showed another thread's printer")
    b = _HeldPrinter("printer-of-B", timeout)
    a.leave()
    b.leave()
    if vars(graph.CodeGen)["_sym_repr"] is not own:
        problems.append("left patched: CodeGen._sym_repr (another thread's printer, for good)")
        graph.CodeGen._sym_repr = own  # for the scenarios after this one
    return Result(
        "FX symbol printer (print_readable(fast_sympy_print=True) in two threads, leaving out of order)",
        bool(problems),
        "; ".join(problems) or "each thread printed with its own printer; CodeGen._sym_repr the class's own after",
    )


FIX = Fix(
    name="fx-sym-repr",
    order=365,
    hazard="a graph printed with print_readable(fast_sympy_print=True) installs its symbol printer for the process: "
    "other threads' printed graphs use it, and two that leave out of order leave one on CodeGen for good",
    versions=releases("2.8"),
    probe=_probe,
    patches=lambda _torch_version: [SlotPatches(MODULE, FUNCTION, owner="CodeGen", attr="_sym_repr", reads=1)],
    trigger=MODULE,
    scenarios=(
        Scenario(
            sym_printer_elsewhere,
            releases("2.8"),
            needs="torch.fx.graph._override_sym_repr (2.8+)",
            shows="another thread's printer",
        ),
    ),
    shared_state=(
        "`torch.fx.graph.CodeGen._sym_repr`, the printer of symbols in readable FX code: "
        "`_override_sym_repr` (from `print_readable(fast_sympy_print=True)`: AOTAutograd's cache key, inductor's "
        "post-grad artifact) writes it on the class and puts back what it found"
    ),
    symptom=(
        "while one thread prints so, another thread's `print_readable()` and graph logs annotate symbols with its "
        "printer; two that leave out of order leave one thread's printer on the class for good (the scenario without "
        "the fix: 5 of 5 runs on torch 2.13, 2.14.1 and 2.15; with it 0 of 5 each). Cosmetic: the code a "
        "GraphModule runs has no such annotations"
    ),
    releases_note='before 2.8: "not needed" (no `_override_sym_repr`)',
    caveats=(
        "While any thread holds a printer, the class attribute holds the dispatcher, a Python function that calls "
        "the calling thread's printer or the class's own."
    ),
    survey_rows=("torch/fx/graph.py: CodeGen._sym_repr",),
)
