"""compiled-autograd-compiler: compiled autograd's compiler slot is a counted override that undoes only itself.

``torch._dynamo.compiled_autograd._enable(compiler_fn)`` (``enable`` before 2.6;
``torch._dynamo.config.compiled_autograd`` enters it) and ``_disable()`` (``disable``; entered by every AOTAutograd
compile and inductor's ``compile_fx``) set the compiled autograd compiler, a C++ slot, one per process
(``torch._C._dynamo.compiled_autograd.set_autograd_compiler``, which returns the previous one), and the Python
mirror ``compiled_autograd_enabled``; at their exit they write back what they found. Thread X inside
``_enable(compiler)``, thread Y entering ``_disable()`` (a compile), X leaving, then Y: Y writes back X's compiler,
which stays for the process, and a later plain ``loss.backward()`` in a thread that never enabled compiled autograd
runs through it (reproduced on 2.2, 2.13, 2.14.1 and 2.15).

The slot's writes in ``_enable``, ``_disable`` and ``reset`` go through a :class:`torchfix.patching.switches.Switch`
instead, the entries of the two as :class:`~torchfix.patching.switches.Override` s: counted across threads, an exit
takes back only its own value, where the slot still holds it; ``compiled_autograd_enabled`` is set at each exit from
the slot then (a compiler in it or not), which in one thread is what torch's exits set. The slot has no getter, and
reading it by setting and restoring it would switch C++'s compiled-autograd hook off and on, which
``Engine::set_compiled_autograd`` refuses while a thread runs a compiled backward ("requires no threads in
backwards()"): the switch tracks the value torch's writes give it, read once when the fix applies.
"""

from __future__ import annotations

import ast
import importlib
import sys
import threading

from .._fix import Fix, Scenario, minor_release, releases
from ..doctor.scenarios import Result
from ..patching.patches import SourcePatch, source_without_import
from ..patching.slots import in_finally
from ..patching.source import Edit, definition, find_replaced, replace_node
from ..patching.switches import Override, Switch

MODULE, RELPATH = "torch._dynamo.compiled_autograd", "torch/_dynamo/compiled_autograd.py"
ENTER, EXIT, SLOT = "_torchfix_ca_enter", "_torchfix_ca_exit", "_torchfix_ca_slot"
SETTER = "torch._C._dynamo.compiled_autograd.set_autograd_compiler"
MIRROR = "compiled_autograd_enabled"


class _CompilerSlot:
    """The C++ compiler slot as a switch whose value, ``(compiler, dynamic)`` (before 2.6 ``(compiler,)``), is
    tracked: torch writes it only through this (the edits), so reading it needs no write."""

    def __init__(self, with_dynamic: bool) -> None:
        import torch

        self._set_in_cpp = torch._C._dynamo.compiled_autograd.set_autograd_compiler
        empty = (None, False) if with_dynamic else (None,)
        found = self._set_in_cpp(*empty)  # the one read by set-and-restore, when the fix applies
        self.value = tuple(found) if with_dynamic else (found,)
        self._set_in_cpp(*self.value)
        self.switch = Switch("compiled_autograd.compiler", lambda: self.value, self.set)

    def set(self, value: object) -> None:
        self._set_in_cpp(*value)  # first: C++ may refuse it
        self.value = tuple(value)

    def write(self, *value: object) -> None:
        """``reset``'s write of the slot (2.4+)."""
        self.set(value)

    def enter(self, compiler: object, *dynamic: bool) -> tuple[Override, None] | Override:
        """What the entry's ``(prior_compiler, prior_dynamic) = set_autograd_compiler(...)`` (before 2.6 ``prior =
        set_autograd_compiler(...)``) calls instead: the entry's override, entered (``prior_dynamic`` unused)."""
        value = (compiler, *dynamic)
        override = Override(lambda: {self.switch: value}, yields_to_compiles=False).enter()
        return (override, None) if dynamic else override

    def exit(self, override: Override, *_dynamic: None) -> None:
        """What the exit's write back calls instead: the override taken back, and ``compiled_autograd_enabled`` set
        from the slot (a compiler in it or not), where torch's exit set it from what its entry found."""
        override.exit()
        setattr(sys.modules[MODULE], MIRROR, self.value[0] is not None)


def _is_setter(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and ast.unparse(node.func) == SETTER


def _is_mirror_if(node: ast.AST) -> bool:
    """``if [not] prior_compiler:`` (before 2.6 ``prior``) ``compiled_autograd_enabled = ...`` in an exit."""
    return isinstance(node, ast.If) and "prior" in ast.unparse(node.test) and MIRROR in ast.unparse(node)


class _CountedCompilerSlot(SourcePatch):
    """``private``: torch 2.6+, whose ``_enable``/``_disable`` set ``(compiler, dynamic)``; before, ``enable`` and
    ``disable`` set the compiler alone."""

    def __init__(self, torch_version: str) -> None:
        super().__init__(MODULE, RELPATH)
        self.private = minor_release(torch_version) >= (2, 6)
        self.reset_writes = minor_release(torch_version) >= (2, 4)  # reset() empties the slot from 2.4

    def describe(self) -> str:
        return super().describe() + f"; adds {SLOT}, a counted override of the compiled-autograd compiler (_switches)"

    def edits(self, source: str) -> list[Edit]:
        """In ``_enable`` and ``_disable`` (``enable``, ``disable``): the entry's ``set_autograd_compiler(...)``
        calls ``ENTER``, the exit's write back ``EXIT`` (which sets the mirror), and the exit's own ``if [not]
        prior_compiler:`` setting of the mirror becomes ``pass``; ``reset`` writes through the slot."""
        edits = []
        for name in ("_enable", "_disable") if self.private else ("enable", "disable"):
            function = definition(source, self.relpath, name)
            exits = in_finally(function)
            setters = find_replaced(self.relpath, function, f"{SETTER} in {name}", _is_setter, count=2)
            (entry,) = [call for call in setters if id(call) not in exits]
            edits.append(replace_node(entry.func, ENTER))
            (block,) = find_replaced(
                self.relpath,
                function,
                f"try of {name} that writes the compiler back",
                lambda n: isinstance(n, ast.Try) and any(_is_setter(c) for b in n.finalbody for c in ast.walk(b)),
            )
            (mirror,) = find_replaced(self.relpath, block.finalbody, f"mirror of {name}'s exit", _is_mirror_if)
            edits.append(replace_node(mirror.body[0], "pass"))
            (restore,) = [call for call in setters if id(call) in exits]
            edits.append(replace_node(restore.func, EXIT))
        if self.reset_writes:
            (write,) = find_replaced(
                self.relpath, definition(source, self.relpath, "reset"), f"{SETTER} in reset", _is_setter
            )
            edits.append(replace_node(write.func, f"{SLOT}.write"))
        return edits

    def helpers(self) -> dict[str, object]:
        slot = _CompilerSlot(with_dynamic=self.private)
        return {SLOT: slot, ENTER: slot.enter, EXIT: slot.exit}


def _probe() -> str | None:
    source = source_without_import(MODULE)
    if source is None or "set_autograd_compiler" not in source:
        return f"{MODULE} sets no compiler (no compiled autograd in this torch)"
    module = importlib.import_module(MODULE)
    return "its compiler slot is counted already" if SLOT in vars(module) else None


class _Held:
    """A thread inside ``context`` (this returns once it is) until :meth:`leave`."""

    def __init__(self, context: object, timeout: float) -> None:
        self.timeout, inside, self.release = timeout, threading.Event(), threading.Event()

        def hold() -> None:
            with context:
                inside.set()
                self.release.wait(timeout)

        self.thread = threading.Thread(target=hold, name="torchfix-selftest", daemon=True)
        self.thread.start()
        inside.wait(timeout)

    def leave(self) -> None:
        self.release.set()
        self.thread.join(self.timeout)


def compiler_left_by_a_compile(timeout: float = 60.0) -> Result | None:
    """Thread X enters ``compiled_autograd._enable(compiler)``, thread Y ``_disable()`` (what a compile does), X
    leaves, then Y. A plain ``backward()`` in the main thread afterwards must not run through compiled autograd, and
    ``compiled_autograd_enabled`` must be False. None before 2.2 (no compiled autograd)."""
    if "set_autograd_compiler" not in (source_without_import(MODULE) or ""):
        return None
    import torch
    from torch._dynamo.utils import counters

    compiled_autograd = importlib.import_module(MODULE)
    private = hasattr(compiled_autograd, "_enable")  # 2.6+; before, enable/disable set the compiler alone
    enable, disable = (
        (compiled_autograd._enable, compiled_autograd._disable)
        if private
        else (compiled_autograd.enable, compiled_autograd.disable)
    )
    x = _Held(enable(lambda graph: graph), timeout)
    y = _Held(disable(), timeout)
    x.leave()
    y.leave()
    enabled = getattr(compiled_autograd, MIRROR)
    captures = counters["compiled_autograd"]["captures"]
    leaf = torch.ones(2, requires_grad=True)
    try:
        (leaf * 2).sum().backward()
        ran = "ran"
    except Exception as exc:
        ran = f"raised {type(exc).__name__}"
    through = counters["compiled_autograd"]["captures"] - captures
    problems = [f"a later plain backward {ran} through another thread's compiled autograd"] if through else []
    problems += [f"left changed: {MIRROR} True"] if enabled else []
    if problems:  # the slot left holding X's compiler: empty it for the scenarios after this one
        torch._C._dynamo.compiled_autograd.set_autograd_compiler(*((None, False) if private else (None,)))
        compiled_autograd.compiled_autograd_enabled = False
    return Result(
        "compiled autograd's compiler (_enable in one thread, a compile's _disable in another, leaving out of order)",
        bool(problems),
        "; ".join(problems) or "the slot empty after both, a later plain backward eager",
    )


FIX = Fix(
    name="compiled-autograd-compiler",
    order=215,
    hazard="compiled autograd's _enable in one thread and a compile's _disable in another, leaving out of order, "
    "leave the enabling thread's compiler in the process: every later backward runs through it",
    versions=releases("2.2"),
    probe=_probe,
    patches=lambda torch_version: [_CountedCompilerSlot(torch_version)],
    trigger=MODULE,
    scenarios=(
        Scenario(
            compiler_left_by_a_compile,
            releases("2.2"),
            needs="compiled autograd (2.2+)",
            shows="through another thread's compiled autograd",
            stage=1,
        ),
    ),
    shared_state=(
        "the compiled-autograd compiler, one C++ slot per process (`torch._C._dynamo.compiled_autograd."
        "set_autograd_compiler`), and its Python mirror `compiled_autograd_enabled`: `compiled_autograd._enable` "
        "(`torch._dynamo.config.compiled_autograd`) sets a compiler, `_disable` (every AOTAutograd compile, "
        "inductor's `compile_fx`) sets none, each writing back what it found at its exit; every backward of every "
        "thread reads the slot"
    ),
    symptom=(
        "thread X inside `_enable(compiler)`, thread Y compiling (`_disable()`), X leaving first: Y writes back X's "
        "compiler, and every later plain `loss.backward()`, in any thread, runs through compiled autograd "
        "(`counters['compiled_autograd']['captures']` grows). The scenario without the fix: 5 of 5 runs on torch 2.2, "
        "2.13, 2.14.1 and 2.15; with it 0 of 5 each"
    ),
    releases_note='`enable`/`disable` before 2.6; before 2.2: "not needed" (no compiled autograd)',
    caveats=(
        "While any thread is inside `_enable`, every thread's backward runs through its compiler (one C++ slot, out "
        "of reach), and a compile's `_disable` in another thread turns it off for all meanwhile, as in torch; "
        "`active_disable_ctx` and `depth` (2.8+) stay torch's process-wide globals (`_enable` in two threads at once "
        "can still fail torch's nesting check). The slot is tracked from torch's own writes: one made directly with "
        "`set_autograd_compiler` is not seen."
    ),
    survey_rows=(
        "torch/_dynamo/compiled_autograd.py: compiled_autograd_enabled",
        "torch/_dynamo/compiled_autograd.py: C++ compiled-autograd compiler slot",
        "torch/_dynamo/compiled_autograd.py: active_disable_ctx, compiled_autograd_enabled, and the C++ "
        "compiler slot (set_autograd_compiler)",
    ),
)
