"""The two kinds of patch a fix is made of: source edits of one module, and module globals made thread-local.

Both compute their edits from the text of the torch file alone (so ``patches/`` can be generated from a
release's source without installing it) and apply them to the live module all-or-nothing: every check
that can fail runs before the first change.
"""

from __future__ import annotations

import ast
import dataclasses
import dis
import importlib
import importlib.util
import itertools
import os
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, ClassVar

from .._fix import Fix, Scenario, SoakCheck, releases
from .cache import cached, text_digest
from .source import (
    Edit,
    PatchedFile,
    ShapeError,
    apply_edits,
    iter_code,
    live_functions,
    parse,
    replace_node,
    segment,
    unified_diff,
)
from .stash import ThreadSpaces

if TYPE_CHECKING:
    import symtable

_GLOBAL_OPS = {"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL"}


def read_source(module: types.ModuleType) -> str:
    path = getattr(module, "__file__", None) or ""
    if not path.endswith(".py") or not os.path.exists(path):
        raise ShapeError(f"{module.__name__}: no Python source to patch (module file: {path or 'none'})")
    return _read_text(path)


def source_without_import(name: str) -> str | None:
    """The source of a module that may not be imported (or exist) yet; None where there is none."""
    try:
        spec = importlib.util.find_spec(name)  # imports the parent packages, not the module
    except ImportError:
        return None
    if spec is None or not (spec.origin or "").endswith(".py"):
        return None
    return _read_text(spec.origin)


_texts: dict[str, tuple[tuple[int, int], str]] = {}  # path -> ((size, modification time), its text)


def _read_text(path: str) -> str:
    """The file's text, read again only where its size or modification time changed: the patches of one file read
    it several times, and one string for it lets ``cache.text_digest`` hash it once."""
    info = os.stat(path)
    stamp = (info.st_size, info.st_mtime_ns)
    kept = _texts.get(path)
    if kept is None or kept[0] != stamp:
        with open(path, encoding="utf-8") as f:
            kept = _texts[path] = (stamp, f.read())
    return kept[1]


@dataclasses.dataclass(frozen=True)
class PerThreadName:
    """A name of torch's that a patch makes per thread, as code outside torch's patched functions reaches it.

    What a thread saw of it without torchfix it must see with it: a read of ``module.name`` (a dotted name is a
    class attribute), a write of it, and the reset by torch's own API. The generated tests check each declared
    name so (tests/test_torchfix_semantics.py)."""

    module: str
    name: str  # in the module: "_is_compiling_flag", "GenerationTracker.generation"
    # The calling thread's value as torch's patched code reads it (the module is the argument), once patched
    seen_by_torch: Callable[[types.ModuleType], object]
    reset: str = ""  # the call of torch's that resets it, as source ("torch._dynamo.reset()"); "" where none does
    written_unseen: str = ""  # why a direct write does not reach torch's code; "" where it does


class SourcePatch:
    """Edits of one torch module's functions, swapped in by ``__code__``.

    Subclasses say which edits (:meth:`edits`, a pure function of the file's text), which objects the edited
    code refers to by name (:meth:`helpers`, put into the module while the patch is applied), and may set up
    other module state (:meth:`_install_state` / :meth:`_remove_state`).
    """

    may_be_absent = False  # whether some releases lack the file (then the patch has nothing to do there)

    def __init__(self, module: str, relpath: str) -> None:
        self.module_name = module
        self.relpath = relpath  # the file inside a torch source tree, e.g. "torch/fx/_symbolic_trace.py"
        self._module: types.ModuleType | None = None
        self._file: PatchedFile | None = None
        self._helpers: list[str] = []

    def edits(self, source: str) -> list[Edit]:
        raise NotImplementedError

    def helpers(self) -> dict[str, object]:
        """Fresh objects the edited code refers to by name: in the module from apply() to revert()."""
        return {}

    def describe(self) -> str:
        """One line for the diff header: what the patch does beyond the text edits."""
        return f"{self.relpath}: the edited functions' code is swapped in place (__code__)"

    def diff(self, read_source: Callable[[str], str]) -> str:
        try:
            source = read_source(self.relpath)
        except OSError:
            if self.may_be_absent:
                return ""
            raise
        return unified_diff(self.relpath, source, apply_edits(source, self.edits(source)))

    def cached_edits(self, source: str) -> list[Edit]:
        """``edits(source)``, kept between processes (``cache``): edits are a function of the file's text and
        of the patch's settings alone, which the key holds. A patch whose settings have no stable text
        (an object's default repr) is not cached."""
        settings = repr(sorted((k, _stable(v)) for k, v in vars(self).items() if not k.startswith("_")))
        if " at 0x" in settings:
            return self.edits(source)
        identity = f"{type(self).__module__}.{type(self).__qualname__}{settings}"
        rows = cached("edits", (identity, text_digest(source)), lambda: [e.row() for e in self.edits(source)])
        return [Edit(*row) for row in rows]

    def apply(self) -> None:
        module = importlib.import_module(self.module_name)
        source = read_source(module)
        self._apply(module, source, self.cached_edits(source))

    def _apply(self, module: types.ModuleType, source: str, edits: list[Edit]) -> None:
        patched_file = PatchedFile.of(module, source)
        swap_in = patched_file.add(self, edits)  # checks everything, changes nothing
        helpers = self.helpers()
        taken = sorted(name for name in helpers if name in vars(module))
        if taken:
            raise ShapeError(f"{self.module_name} has {', '.join(taken)} already")
        self._install_state(module, source)
        vars(module).update(helpers)
        swap_in()
        self._module, self._file, self._helpers = module, patched_file, list(helpers)

    @property
    def patched(self) -> bool:
        return self._module is not None

    def revert(self) -> None:
        if self._file is None:
            return
        self._file.remove(self)
        for name in self._helpers:
            vars(self._module).pop(name, None)
        self._remove_state(self._module)
        self._module = self._file = None

    def verify(self) -> None:
        if self._file is None or not self._file.is_applied(self):
            raise ShapeError(f"{self.module_name}: patched code is not in place")

    def _install_state(self, module: types.ModuleType, source: str) -> None:
        pass

    def _remove_state(self, module: types.ModuleType) -> None:
        pass

    def per_thread_names(self) -> list[PerThreadName]:
        """The names of torch's this patch makes per thread (in this release, importing the module)."""
        return []

    def patched_code(self) -> set[types.CodeType]:
        return self._file.codes_of(self) if self._file is not None else set()


def torchfix_files() -> frozenset[str]:
    """Every source file of the torchfix package, named as its modules' ``__file__`` (what ``inspect.getfile``
    gives for torch's modules, and a frame's ``co_filename``): the files of the frames torchfix adds to torch's
    stacks, for the fixes that keep them out of what torch records."""
    root = os.path.dirname(os.path.dirname(__file__))
    return frozenset(
        os.path.join(folder, name) for folder, _, names in os.walk(root) for name in names if name.endswith(".py")
    )


def _stable(value: object) -> object:
    """``value`` with its sets sorted: their order changes between processes (string hashing is random)."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items()}
    return value


def _module_level_names(source: str) -> set[str]:
    """Names the module body assigns (``x = ...``, ``x: T = ...``), as the file defines its globals."""
    names = set()
    for node in parse(source).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            names.update(target.id for target in _assign_targets(node) if isinstance(target, ast.Name))
    return names


_IMMUTABLE = (bool, int, float, str, bytes, type(None))


@dataclasses.dataclass(frozen=True)
class _Default:
    """A moved global's value in a thread that has not set one: what the file assigns at module level.

    * an immutable literal (a flag), or an object (``DynamoStance()``, a value its users replace, never change):
      one value shared by every thread, kept in the module as ``<name>_shared`` for the fast reads;
    * a mutable literal (``{}``, which its users fill in place), or an object its patch names as one its
      users change in place (a mode stack): each thread gets its own, made on its first read, and every
      read goes to the thread's.
    """

    source: str  # the expression, as the file spells it
    value: object = None  # the literal's value
    kind: str = "object"  # "flag", "object" or "own"

    def fast_read(self, name: str, value: str, attribute: bool = False) -> str:
        """The read of the moved global ``name`` whose per-thread value is the expression ``value`` (``attribute``:
        a read whose attribute is read next, ``_stance.stance``).

        ``<name>_shared`` (:func:`per_thread_class` switches it) serves every thread the shared value while no
        thread holds one of its own, with no call, and sends the read to the holder while some does:

        * a flag's holds a :class:`_SharedFlag` or an :class:`_OwnFlag`, and the read is ``<name>_shared.value``:
          the global's load and one attribute read, on Python 3.11 and 3.12 alike (a test and a jump, ``(<name>_shared
          and <value>)``, took one more instruction on 3.12, whose ``and`` copies the value it tests);
        * an object's holds the object, or an :class:`_OwnValues` (false, and serving attribute reads from the
          thread's own object): an attribute read of it is the global's load alone, any other read
          ``(<name>_shared or <value>)``."""
        if self.kind == "own":
            return value
        if self.kind == "flag":
            return f"{name}_shared.value"
        return f"{name}_shared" if attribute else f"({name}_shared or {value})"


class _SharedFlag:
    """What ``<name>_shared`` of a flag holds while no thread holds a value of its own: the value every thread
    reads, as ``.value``."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value


class _OwnFlag:
    """What ``<name>_shared`` of a flag holds while some thread holds a value of its own: ``.value`` is the calling
    thread's."""

    __slots__ = ("_holder", "_attr")

    def __init__(self, holder: object, attr: str) -> None:
        self._holder, self._attr = holder, attr

    @property
    def value(self) -> object:
        return getattr(self._holder, self._attr)


class _OwnValues:
    """What ``<name>_shared`` of an object holds while some thread holds one of its own: false, so that a read of
    the object goes to the holder, and serving an attribute read from the calling thread's object."""

    __slots__ = ("_holder", "_attr")

    def __init__(self, holder: object, attr: str) -> None:
        self._holder, self._attr = holder, attr

    def __bool__(self) -> bool:
        return False

    def __getattr__(self, name: str) -> object:
        return getattr(getattr(self._holder, self._attr), name)


def _module_level_defaults(source: str, names: set[str]) -> dict[str, _Default]:
    """The defaults of ``names``, from their module-level assignments.

    Kept between processes (``cache``) as where those assignments are in the file (offsets: data, never code),
    so a warm start parses those lines alone, of torch's own file, as a cold one does. An entry that points at
    anything but whole lines, or whose lines do not assign the names, raises (and is rebuilt)."""
    spans = cached("defaults", (text_digest(source), repr(sorted(names))), lambda: _assignment_spans(source, names))
    return _parse_defaults("".join(_whole_lines(source, start, end) for start, end in spans), names)


def _assignment_spans(source: str, names: set[str]) -> list[tuple[int, int]]:
    """Where the module-level statements assigning any of ``names`` are: (first, past last) character offsets
    of their lines."""
    line_starts = [0, *itertools.accumulate(len(line) + 1 for line in source.split("\n"))]
    return [
        (line_starts[node.lineno - 1], min(line_starts[node.end_lineno], len(source)))
        for node in parse(source).body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        and node.value is not None
        and any(isinstance(t, ast.Name) and t.id in names for t in _assign_targets(node))
    ]


def _whole_lines(source: str, start: object, end: object) -> str:
    if not (
        type(start) is int
        and type(end) is int
        and 0 <= start < end <= len(source)
        and (start == 0 or source[start - 1] == "\n")
        and (end == len(source) or source[end - 1] == "\n")
    ):
        raise ShapeError(f"the cached defaults name characters {start!r} - {end!r}, not whole lines of the file")
    return source[start:end] if source[end - 1] == "\n" else source[start:end] + "\n"


def _assign_targets(node: ast.Assign | ast.AnnAssign) -> list[ast.expr]:
    return node.targets if isinstance(node, ast.Assign) else [node.target]


def _parse_defaults(statements: str, names: set[str]) -> dict[str, _Default]:
    found = {}
    for node in ast.parse(statements).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            for target in _assign_targets(node):
                if isinstance(target, ast.Name) and target.id in names:
                    text = ast.get_source_segment(statements, node.value)
                    try:
                        value = ast.literal_eval(node.value)
                    except ValueError:
                        found[target.id] = _Default(text)
                        continue
                    found[target.id] = _Default(text, value, "flag" if isinstance(value, _IMMUTABLE) else "own")
    return found


def _function_scopes(table: symtable.SymbolTable) -> Iterator[symtable.SymbolTable]:
    for child in table.get_children():
        if child.get_type() == "function":
            yield child
        yield from _function_scopes(child)


def _global_uses(source: str, filename: str, name: str) -> tuple[list[ast.Name], list[ast.Global]]:
    """The ``Name`` nodes inside functions that compile to global access of ``name``, and the
    ``global`` statements that declare it.

    Whether a name in a function is global is the compiler's call (a parameter, an assignment or a
    ``global`` statement anywhere in the function changes it), so ask ``symtable`` rather than guess.
    """
    import symtable  # here: only a cold cache works out edits (the import: about 1 ms on the CPU machine)

    tree = parse(source)
    global_scopes = {
        (scope.get_name(), scope.get_lineno())
        for scope in _function_scopes(symtable.symtable(source, filename, "exec"))
        if name in scope.get_identifiers() and scope.lookup(name).is_global()
    }
    names: list[ast.Name] = []
    declarations: list[ast.Global] = []

    def visit(node: ast.AST, in_global_scope: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            scope_name = "lambda" if isinstance(node, ast.Lambda) else node.name
            in_global_scope = (scope_name, node.lineno) in global_scopes
        elif isinstance(node, ast.ClassDef):
            in_global_scope = False  # class bodies run once, at import; they use LOAD_NAME
        if in_global_scope and isinstance(node, ast.Name) and node.id == name:
            if isinstance(node.ctx, ast.Del):
                raise ShapeError(f"line {node.lineno}: `del {name}` cannot be made thread-local")
            names.append(node)
        if isinstance(node, ast.Global) and name in node.names:
            declarations.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child, in_global_scope)

    visit(tree, False)
    return names, declarations


def _at(node: ast.AST) -> tuple[int, int]:
    return node.lineno, node.col_offset


def per_thread_class(
    holder: str,
    defaults: dict[str, object],
    factories: dict[str, Callable[[], object]],
    *,
    seen_in_backward: bool,
    on_change: Callable[[bool], None] | None = None,
) -> type:
    """The holder's type: one attribute per name, with its default (``defaults``, or a value made per thread by
    ``factories``), kept per thread; the caller says whether autograd's device thread sees the values of the thread
    whose backward it runs.

    ``seen_in_backward=True``: one property per name, kept in :class:`ThreadSpaces`, and ``overridden``, how many
    (thread, name) pairs hold something else than their shared default.

    A per-thread read costs several times a global read, and torch reads these flags (and the compile stance) on
    every compiled call. The rewritten reads of a global with a shared default (``defaults``) take the thread's
    value only while some thread has set one of its own, which is rare (during a trace or an export): ``on_change``
    is called (under the lock) with whether ``overridden`` is non-zero whenever that changes, and switches the
    module global those reads test first (see ``_Default.fast_read``). Writes are rare and take a lock to keep the
    count exact. A thread that dies holding a non-default value keeps the count above zero: reads stay correct,
    only slower. A global with a default of its own per thread (``factories``) is read through the property every
    time: each thread gets its own object on its first read.

    ``seen_in_backward=False``: a plain ``threading.local`` instead, where autograd's device thread sees the
    defaults; a class may add methods by subclassing it. For state that torch writes on every call (whether a
    compiled module's call is under way) and that means nothing in a backward: its reads and writes are attribute
    accesses, no Python call (a property's write, with its lock and the C++ stash, cost 1.7 us, against a 54 us
    compiled module call on the CPU machine).
    """
    if not seen_in_backward:

        def make_own(self: object) -> None:  # threading.local runs it in each thread at its first access
            for attr, make in factories.items():
                setattr(self, attr, make())

        return type(holder, (threading.local,), {"__init__": make_own, **defaults})

    def per_thread(attr: str, default: object) -> property:
        def get(self: object) -> object:
            return getattr(self._spaces.get(), attr, default)  # getattr(None, ...): the default

        def set_(self: object, value: object) -> None:
            with self._lock:
                space = self._spaces.make()
                old = getattr(space, attr, default)
                setattr(space, attr, value)
                was = self.overridden
                self.overridden += (value != default) - (old != default)
                if on_change is not None and bool(was) != bool(self.overridden):
                    on_change(bool(self.overridden))

        return property(get, set_)

    def per_thread_object(attr: str, make: Callable[[], object]) -> property:
        def get(self: object) -> object:
            space = self._spaces.make()
            try:
                return getattr(space, attr)
            except AttributeError:
                value = make()
                setattr(space, attr, value)
                return value

        def set_(self: object, value: object) -> None:
            setattr(self._spaces.make(), attr, value)

        return property(get, set_)

    def __init__(self: object) -> None:
        self._spaces, self._lock, self.overridden = ThreadSpaces(holder, seen_in_backward=True), threading.Lock(), 0

    namespace = {attr: per_thread(attr, default) for attr, default in defaults.items()}
    namespace |= {attr: per_thread_object(attr, make) for attr, make in factories.items()}
    return type(holder, (), {"__slots__": ("_spaces", "_lock", "overridden"), "__init__": __init__, **namespace})


def moved_global_probe(module: str, holder: str, name: str, absent: str) -> Callable[[], str | None]:
    """The probe of a fix that moves ``module``'s global ``name`` to ``holder``: "not needed" where the holder is
    there (the fix is in) or the global is not (``absent`` says why); None (needed) otherwise."""

    def probe() -> str | None:
        try:
            found = importlib.util.find_spec(module)
        except ModuleNotFoundError:  # its package is missing too
            found = None
        if found is None:  # a release before the module: nothing of it to fix
            return absent
        namespace = vars(importlib.import_module(module))
        if holder in namespace:
            return f"{module}.{name} is per thread already"
        return None if name in namespace else absent

    return probe


def moved_globals_fix(
    name: str,
    hazard: str,
    first: str,
    module: str,
    holder: str,
    moved: dict[str, str],
    *,
    order: int,
    optional: frozenset[str] = frozenset(),
    own: frozenset[str] = frozenset(),
    seen_in_backward: bool,
    set_often: bool = False,
    trigger: str = "torch",
    scenarios: tuple[Scenario, ...] = (),
    soak: SoakCheck | None = None,
    survey_rows: tuple[str, ...] = (),
    **facts: str,
) -> Fix:
    """A fix that moves globals of one torch module to per-thread storage (:class:`ThreadLocalGlobals`; ``optional``,
    ``own``, ``seen_in_backward`` and ``set_often`` are its), and does nothing else: from torch ``first`` (before it,
    the first of ``moved`` does not exist) through the newest checked release. ``order``, ``facts`` (``symptom`` and
    the other texts of the table of fixes), ``soak``, ``survey_rows`` and the rest are :class:`Fix`'s."""
    probed = next(iter(moved))
    return Fix(
        name=name,
        hazard=hazard,
        versions=releases(first),
        probe=moved_global_probe(module, holder, probed, f"{module} has no {probed} (before torch {first})"),
        patches=lambda _torch_version: [
            ThreadLocalGlobals(
                module,
                module.replace(".", "/") + ".py",
                holder,
                moved,
                optional=optional,
                own=own,
                seen_in_backward=seen_in_backward,
                set_often=set_often,
            )
        ],
        order=order,
        trigger=trigger,
        scenarios=scenarios,
        soak=soak,
        survey_rows=survey_rows,
        **facts,
    )


def refuse_accesses_left(module: types.ModuleType, opnames: set[str], names: set[str], holder: str = "") -> None:
    """Raise :class:`ShapeError` naming the instructions of ``opnames`` on ``names`` still in the module's live
    functions ("function: OPNAME name"): what a patch that rewrote every such access must not find. An attribute
    read right off ``holder`` (``target.HOLDER.NAME``, where a holder's attribute keeps the global's name) is a
    rewritten one."""
    left = []
    for func in live_functions(module):
        for code in iter_code(func.__code__):
            if names.isdisjoint(code.co_names):  # disassemble only code that names them
                continue
            previous = None
            for ins in dis.get_instructions(code):
                rewritten = previous is not None and previous.opname == "LOAD_ATTR" and previous.argval == holder
                if ins.opname in opnames and ins.argval in names and not (holder and rewritten):
                    left.append(f"{getattr(code, 'co_qualname', code.co_name)}: {ins.opname} {ins.argval}")
                previous = ins
    if left:
        raise ShapeError(f"{module.__name__}: access left after patching: {', '.join(left)}")


class ThreadLocalGlobals(SourcePatch):
    """Make module globals per-thread: ``module.NAME`` becomes ``module.HOLDER.ATTR``.

    * Functions of the module that read or write ``NAME`` (``LOAD_GLOBAL``/``STORE_GLOBAL``) are
      rewritten to use the per-thread attribute of an object stored in the module as ``HOLDER``; reads
      take a fast path while no thread has a value of its own (see :func:`per_thread_class`).
    * ``NAME`` leaves the module dict while some thread holds a value of its own (always, for a value each thread
      has its own of): reads of ``module.NAME`` from other modules then reach a module ``__getattr__`` (PEP 562)
      that returns the calling thread's value (see :class:`_MovedGlobals`); torch's own writers from other
      modules are rewritten by :class:`AttributeUses`. The module keeps its class: Dynamo checks
      modules with ``type(m) is ModuleType`` in places (imports inside compiled code, torch <= 2.2's
      variable builder), and a module subclass would break or graph-break those.
    * :meth:`verify` scans every code object of the module with ``dis`` to prove no global access to
      ``NAME`` is left, and checks that ``module.NAME`` reads the per-thread value.
    """

    def __init__(
        self,
        module: str,
        relpath: str,
        holder: str,
        attrs: dict[str, str],
        *,
        seen_in_backward: bool,
        optional: frozenset[str] = frozenset(),
        own: frozenset[str] = frozenset(),
        set_often: bool = False,
    ) -> None:
        super().__init__(module, relpath)
        self.holder = holder
        self.attrs = attrs  # global name -> attribute of the thread-local holder
        # Names some releases do not have yet (torch adds flags over time): moved where the file defines them. A
        # release that defines none of its names (all optional) has nothing to patch in this module.
        self.optional = optional
        # Names whose object (not a literal) its users change in place: each thread gets one of its own,
        # made by the file's expression; shared, one thread's change would show in all.
        self.own = own
        # Whether a backward on autograd's device thread sees the thread's values (False: a plain threading.local
        # holder, read and written with no call; see per_thread_class)
        self.seen_in_backward = seen_in_backward
        # Whether torch sets them at a rate (every dispatch mode's enter and exit) at which taking them out of the
        # module's dict and back (_MovedGlobals.keep_in_dict) costs more than the attribute reads it makes faster:
        # then they stay out, served by the module __getattr__ (a mode around one op: 23.5 k enters a second with
        # them out for good, 18.4 k moving them; CPU machine, Python 3.11).
        self.set_often = set_often
        self._moved: dict[str, str] = {}  # the attrs moved in the live module
        self._served: dict[str, object] = {}  # the moved names the module's dict holds while no thread has its own
        self._nothing_here = False  # apply() found none of the names (every one optional): nothing to patch

    def _present(self, defined: object) -> dict[str, str]:
        return {name: attr for name, attr in self.attrs.items() if name not in self.optional or name in defined}

    def apply(self) -> None:
        # A release that defines none of the names (all optional) has nothing to move: the module is left as it is
        # (no holder, no recompiled file), as AttributeUses leaves a module that does not use its names; unless a
        # subclass edits more than the names (trace-patch-isolation's dispatcher, on torch 2.0 - 2.4).
        module = importlib.import_module(self.module_name)
        self._nothing_here = not self._present(vars(module)) and not self.cached_edits(read_source(module))
        if not self._nothing_here:
            super().apply()

    def _defaults(self, source: str, names: set[str]) -> dict[str, _Default]:
        defaults = _module_level_defaults(source, names)
        return {
            name: dataclasses.replace(default, kind="own") if name in self.own else default
            for name, default in defaults.items()
        }

    def edits(self, source: str) -> list[Edit]:
        edits = []
        present = self._present(_module_level_names(source))
        defaults = self._defaults(source, set(present))
        declarations: dict[int, ast.Global] = {}  # one `global a, b` may declare several moved names
        bases = {  # names whose attribute is read next (``NAME.attr``; a dunder is the object's own)
            _at(node.value)
            for node in ast.walk(parse(source))
            if isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Load)
            and isinstance(node.value, ast.Name)
            and not node.attr.startswith("__")
        }
        for name, attr in present.items():
            uses, declared = _global_uses(source, self.relpath, name)
            if not uses:
                raise ShapeError(f"{self.relpath}: no function uses the global {name}")
            value = f"{self.holder}.{attr}"
            default = defaults[name] if self.seen_in_backward else _Default("", kind="own")  # "own": read directly
            edits += [
                replace_node(
                    use, default.fast_read(name, value, _at(use) in bases) if isinstance(use.ctx, ast.Load) else value
                )
                for use in uses
            ]
            declarations.update((id(decl), decl) for decl in declared)
        return edits + [self._drop_declaration(source, decl, present) for decl in declarations.values()]

    def describe(self) -> str:
        moved = ", ".join(f"{name} -> {self.holder}.{attr}" for name, attr in self.attrs.items())
        where = f" ({', '.join(sorted(self.optional))} only where the file defines them)" if self.optional else ""
        fast = "; a read tests `<name>_shared` first, the value every thread shares while none has its own"
        in_dict = ", which the module's dict then holds instead of the __getattr__"  # keep_in_dict
        return (
            f"{self.relpath}: module globals moved to per-thread storage ({moved}){where}; "
            f"`{self.module_name}.<name>` read from other modules goes through a module __getattr__"
            + (fast if self.seen_in_backward else "")
            + (in_dict if self.seen_in_backward and not self.set_often else "")
        )

    def _drop_declaration(self, source: str, decl: ast.Global, moved: dict[str, str]) -> Edit:
        others = [n for n in decl.names if n not in moved]
        if others:
            return replace_node(decl, "global " + ", ".join(others))
        line = source.splitlines()[decl.lineno - 1].encode()
        alone = line[: decl.col_offset].strip() == b"" and line[decl.end_col_offset :].strip() == b""
        # A comment keeps the line (line numbers must not move) and tells the reader where it went.
        where = ", ".join(f"{name} is thread-local: {self.holder}.{moved[name]}" for name in decl.names)
        return replace_node(decl, f"# {where}" if alone else "pass")

    def _install_state(self, module: types.ModuleType, source: str) -> None:
        namespace = vars(module)
        moved = self._present(namespace)
        missing = [name for name in moved if name not in namespace]
        if missing or self.holder in namespace:
            raise ShapeError(f"{module.__name__}: expected globals {missing} and no {self.holder}")
        # The file's initial values are every thread's defaults; a value set before the install (say a flag left
        # stuck) stays the installing thread's own, and so does the object a global holds (the stance set so far,
        # the node meta being filled in).
        defaults = self._defaults(source, set(moved))
        shared, factories = {}, {}
        for name, default in defaults.items():
            if default.kind == "flag":
                shared[moved[name]] = default.value
                continue
            make = eval(f"lambda: {default.source}", namespace)  # noqa: S307 (torch's own expression, in its module)
            if default.kind == "own":
                factories[moved[name]] = make
            else:  # the module's object where it equals a fresh default (nothing set yet), so it stays shared
                current, fresh = namespace[name], make()
                shared[moved[name]] = current if current == fresh else fresh
                if not shared[moved[name]]:
                    raise ShapeError(f"{module.__name__}.{name}: a false default, which the fast reads cannot tell")
        fast = [name for name, default in defaults.items() if default.kind != "own" and self.seen_in_backward]
        taken = sorted(f"{name}_shared" for name in fast if f"{name}_shared" in namespace)
        if taken:
            raise ShapeError(f"{module.__name__} has {', '.join(taken)} already")

        # While no thread holds a value of its own, the module's dict holds the shared values too, for reads of
        # `module.NAME` (see _MovedGlobals.keep_in_dict).
        served = {} if self.set_often else {name: shared[moved[name]] for name in fast}
        moved_globals = _MovedGlobals.of(module)

        def switch(some_own: bool) -> None:  # the fast reads' globals: the shared values, or "go to the holder"
            if namespace.get(self.holder) is holder:  # not after the revert
                namespace.update({f"{name}_shared": (own if some_own else reads)[name] for name in fast})
                if served:
                    moved_globals.keep_in_dict(served, kept=not some_own)

        holder = per_thread_class(
            self.holder, shared, factories, seen_in_backward=self.seen_in_backward, on_change=switch
        )()
        flags = {name for name in fast if defaults[name].kind == "flag"}
        reads = {name: _SharedFlag(shared[moved[name]]) if name in flags else shared[moved[name]] for name in fast}
        own = {name: (_OwnFlag if name in flags else _OwnValues)(holder, moved[name]) for name in fast}
        namespace[self.holder] = holder
        values = moved_globals.add({name: (holder, attr) for name, attr in moved.items()})
        try:
            switch(False)
            for name, attr in moved.items():
                if attr in factories or values[name] is not shared[attr]:
                    setattr(holder, attr, values[name])  # compares the value with the default: may raise
        except BaseException:  # the names are out of the dict: put the module back as it was, then refuse
            del namespace[self.holder]
            for name in fast:
                namespace.pop(f"{name}_shared", None)
            namespace.update(values)
            moved_globals.remove(moved)
            raise
        self._moved, self._served = moved, served

    def _remove_state(self, module: types.ModuleType) -> None:
        namespace = vars(module)
        holder = namespace.pop(self.holder)
        # The calling thread's values become the shared globals again.
        for name, attr in self._moved.items():
            namespace[name] = getattr(holder, attr)
            namespace.pop(f"{name}_shared", None)
        _MovedGlobals.of(module).remove(self._moved)
        self._moved, self._served = {}, {}

    def verify(self) -> None:
        if self._nothing_here:
            return
        super().verify()
        module = self._module
        refuse_accesses_left(module, _GLOBAL_OPS, set(self._moved))
        namespace, served = vars(module), self._served
        # In the dict only as the shared value that keep_in_dict put there (a global's value can be None too).
        back = [name for name in self._moved if name in namespace and namespace[name] is not served.get(name, self)]
        if back:
            raise ShapeError(f"{module.__name__}: {', '.join(back)} came back into the module dict")
        self._verify_per_thread(module)

    def _verify_per_thread(self, module: types.ModuleType) -> None:
        """Behaviour, not just bytecode: ``module.NAME``, which other modules read, serves the calling thread's
        value from the holder. (That the holder keeps a value per thread is :func:`per_thread_class`'s, the same on
        every release and tested there; checking it here took a thread start per patch: 2.3 ms of the import on the H200
        machine.)"""
        holder = vars(module)[self.holder]
        for name, attr in self._moved.items():
            own, probe = getattr(holder, attr), object()
            setattr(holder, attr, probe)
            try:
                served = getattr(module, name)
            finally:
                setattr(holder, attr, own)  # a thread that keeps a value of its own slows every read
            if served is not probe:
                raise ShapeError(f"{module.__name__}.{name} does not read its per-thread value after patching")

    def per_thread_names(self) -> list[PerThreadName]:
        module = importlib.import_module(self.module_name)
        present = self._present(_module_level_names(read_source(module)))
        return [
            PerThreadName(
                self.module_name,
                name,
                lambda module, attr=attr: getattr(vars(module)[self.holder], attr),
                written_unseen=_MODULE_WRITE_UNSEEN,
            )
            for name, attr in present.items()
        ]


# A module attribute write cannot be intercepted but by giving the module a class of its own, which Dynamo tells
# from a module (it checks `type(m) is ModuleType`); PEP 562 gives modules a __getattr__ and no __setattr__.
_MODULE_WRITE_UNSEEN = (
    "`module.NAME = value` from outside the module puts NAME back into the module's dict, where torch's patched "
    "code (which reads the per-thread holder) does not look; a module __setattr__ would need a module subclass, "
    "which Dynamo does not treat as a module"
)


def fast_read_globals(module: types.ModuleType) -> set[str]:
    """The ``<name>_shared`` globals that the fast reads of ``module``'s moved globals test (torchfix's own: they
    switch while some thread holds a value of its own, see ``_Default.fast_read``)."""
    return {f"{name}_shared" for name in _MovedGlobals.of(module).moved}


class _MovedGlobals:
    """The module ``__getattr__`` (PEP 562) that serves the moved globals of one module, whichever patch moved them,
    while one is out of the module's dict: patches of one module come and go in any order, and the ``__getattr__``
    the module had before the first of them is restored after the last.

    CPython does not specialise an attribute read of a module that has a ``__getattr__``, any attribute's
    (``torch.compiler.is_exporting``, read on every compiled call, and every other): 16 ns more a read on Python
    3.11, 23 on 3.12 on the CPU machine. So a moved global that every thread reads as the shared value (no thread
    holds one of its own, which is most of the time) stays in the dict as that value (``keep_in_dict``), and the
    module has the ``__getattr__`` only while some moved global is out of it. Those switches are rare (a compiled
    training step makes none; a compile a few per module); the globals torch sets far more often stay out
    (``ThreadLocalGlobals.set_often``)."""

    _by_module: ClassVar[dict[str, _MovedGlobals]] = {}

    def __init__(self, module: types.ModuleType) -> None:
        self.namespace = vars(module)
        self.previous = self.namespace.get("__getattr__")
        self.moved: dict[str, tuple[object, str]] = {}  # global name -> (holder, attribute)
        self.serving = self._getattr()
        # The holders of one module switch from any thread: a switch's removals and the __getattr__ go together.
        self.lock = threading.Lock()

    @classmethod
    def of(cls, module: types.ModuleType) -> _MovedGlobals:
        found = cls._by_module.get(module.__name__)
        return found if found is not None and found.namespace is vars(module) else cls(module)

    def add(self, moved: dict[str, tuple[object, str]]) -> dict[str, object]:
        """Serve ``moved`` from the holders; returns the values they had in the module's dict, which they leave."""
        with self.lock:
            self._by_module[self.namespace["__name__"]] = self
            self.moved.update(moved)
            self.namespace["__getattr__"] = self.serving  # before the names leave: a read never misses
            return {name: self.namespace.pop(name) for name in moved}

    def remove(self, names: Iterable[str]) -> None:
        """Stop serving ``names`` (put back into the module's dict by the caller)."""
        with self.lock:
            for name in names:
                self.moved.pop(name, None)
            if not self.moved:
                del self._by_module[self.namespace["__name__"]]
            self._refresh()

    def keep_in_dict(self, values: dict[str, object], kept: bool) -> None:
        """Where ``kept``, put the moved globals ``values`` (name -> the value every thread reads) in the module's
        dict; else take them out (a thread holds a value of its own), to the ``__getattr__``. A value written into
        the module since (``module.NAME = x``, which torch's patched code does not see) stays, as it would without
        this: it shadows the ``__getattr__`` for that name."""
        with self.lock:
            if kept:
                for name, value in values.items():
                    self.namespace.setdefault(name, value)
            else:
                self.namespace["__getattr__"] = self.serving
                for name, value in values.items():
                    if self.namespace.get(name, self) is value:
                        del self.namespace[name]
            self._refresh()

    def _refresh(self) -> None:
        if any(name not in self.namespace for name in self.moved):
            self.namespace["__getattr__"] = self.serving
        elif self.namespace.get("__getattr__") is self.serving:
            if self.previous is None:
                del self.namespace["__getattr__"]
            else:
                self.namespace["__getattr__"] = self.previous

    def _getattr(self) -> types.FunctionType:
        moved, previous, module_name = self.moved, self.previous, self.namespace["__name__"]

        def __getattr__(name: str) -> object:
            found = moved.get(name)
            if found is not None:
                return getattr(*found)
            if previous is not None:
                return previous(name)
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

        return __getattr__


class WhereUsed(SourcePatch):
    """A patch of a module that may not use what it edits: a release that lacks the module, or whose module does not
    use the names, gets no edits. The module is imported only where it needs edits (some are costly:
    ``torch.export._trace``, 1.5 s), and once patched, none of :meth:`accesses` may be left in it."""

    may_be_absent = True

    def accesses(self) -> tuple[set[str], set[str], str]:
        """The opnames and names no code of the patched module may use any more, and the holder a rewritten
        attribute read comes off (see :func:`refuse_accesses_left`)."""
        raise NotImplementedError

    def apply(self) -> None:
        source = source_without_import(self.module_name)
        edits = self.cached_edits(source) if source is not None else []
        if edits:
            self._apply(importlib.import_module(self.module_name), source, edits)

    def verify(self) -> None:
        if self._module is None:
            return  # nothing to patch in this release
        super().verify()
        refuse_accesses_left(self._module, *self.accesses())


class AttributeUses(WhereUsed):
    """Another module's ``target.NAME`` reads and writes, rewritten to ``target.HOLDER.ATTR``.

    The companion of :class:`ThreadLocalGlobals` for the modules that write the moved names by module
    attribute (``torch.fx._symbolic_trace._is_fx_tracing_flag = False``): a module ``__getattr__`` can
    serve reads, but nothing serves writes.
    """

    def __init__(self, module: str, relpath: str, target: str, holder: str, attrs: dict[str, str]) -> None:
        super().__init__(module, relpath)
        self.target, self.holder, self.attrs = target, holder, attrs

    def describe(self) -> str:
        return f"{self.relpath} (where it uses them): `{self.target}.<name>` -> `{self.target}.{self.holder}.<attr>`"

    def edits(self, source: str) -> list[Edit]:
        edits = []
        for node in ast.walk(parse(source)):
            if isinstance(node, ast.Attribute) and node.attr in self.attrs:
                base = segment(source, node.value)
                if base != self.target:  # an alias we cannot follow: refuse rather than miss a write
                    raise ShapeError(f"{self.relpath} line {node.lineno}: {base}.{node.attr} is not {self.target}")
                edits.append(replace_node(node, f"{self.target}.{self.holder}.{self.attrs[node.attr]}"))
        return edits

    def accesses(self) -> tuple[set[str], set[str], str]:
        return {"LOAD_ATTR", "STORE_ATTR"}, set(self.attrs), self.holder


class ImportedNameUses(AttributeUses):
    """:class:`AttributeUses`, and the bare ``NAME`` of a module that imported it by name (``from target import
    NAME``), rewritten to ``target.HOLDER.ATTR`` too.

    Such a name holds the object it had at import: one thread's, or, where torch rebinds the global, a stale one.
    Its uses read the calling thread's instead, through ``target`` as the module ``torch`` reaches it (the module
    must ``import torch`` or ``torch.x``).
    """

    def describe(self) -> str:
        return (
            f"{self.relpath} (where it uses them): `{self.target}.<name>`, and the names it imports from there, "
            f"-> `{self.target}.{self.holder}.<attr>`"
        )

    def edits(self, source: str) -> list[Edit]:
        edits = super().edits(source)
        for name in self._imported_by_name(source):
            uses, declared = _global_uses(source, self.relpath, name)
            if declared or any(not isinstance(use.ctx, ast.Load) for use in uses):
                raise ShapeError(f"{self.relpath}: assigns {name}, which it imports from {self.target}")
            edits += [replace_node(use, f"{self.target}.{self.holder}.{self.attrs[name]}") for use in uses]
        return edits

    def _imported_by_name(self, source: str) -> set[str]:
        """The moved names the module imports from ``target`` by name (at module level: a function that did would
        hold its own copy, which is refused)."""
        tree, names = parse(source), set()
        package = self.module_name if self.relpath.endswith("__init__.py") else self.module_name.rpartition(".")[0]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            origin = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            found = {alias.name for alias in node.names if alias.name in self.attrs} if origin == self.target else set()
            if found and (node not in tree.body or any(alias.asname for alias in node.names if alias.name in found)):
                raise ShapeError(
                    f"{self.relpath} line {node.lineno}: an import of {', '.join(sorted(found))} we cannot follow"
                )
            names |= found
        binds_torch = any(
            isinstance(node, ast.Import)
            and any(alias.name.partition(".")[0] == "torch" and not alias.asname for alias in node.names)
            for node in tree.body
        )
        if names and not (binds_torch and self.target.startswith("torch.")):
            raise ShapeError(f"{self.relpath} imports {', '.join(sorted(names))} by name, and not torch")
        return names

    def verify(self) -> None:
        super().verify()
        if self._module is not None:
            refuse_accesses_left(self._module, _GLOBAL_OPS, set(self.attrs))
