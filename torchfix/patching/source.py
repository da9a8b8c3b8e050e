"""Source-level patching: text edits of a torch module's file, compiled and swapped in by ``__code__``.

A patch is a list of :class:`Edit` spans computed from the *text* of a torch source file. Editing text
rather than unparsing an AST keeps the file's formatting, so every patch is a real unified diff that a
reviewer can read (``patches/`` and ``python -m torchfix diff``). Edits never add or remove lines, so the
patched file compiles with the original file name and line numbers: tracebacks, ``inspect`` and
debuggers keep pointing at the right lines of the file on disk.

The live module is patched by compiling the whole edited file (without running it) and replacing the
``__code__`` of each edited function in place. Replacing code rather than rebinding names keeps every
function's identity, so references captured earlier still see the change: ``from x import f`` copies,
and the predicates Dynamo captures when ``torch.compile`` wraps a function (torch 2.3+).
"""

from __future__ import annotations

import ast
import difflib
import functools
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar

from .cache import cached, digest, text_digest


class ShapeError(Exception):
    """The torch source does not have the shape a patch was written for."""


@dataclass(frozen=True)
class Edit:
    """Replace the text between two positions of one line with ``text``.

    Positions are those of the ``ast`` module: 1-based line numbers and 0-based UTF-8 byte columns.
    """

    line: int
    start_col: int
    end_col: int
    text: str

    def row(self) -> tuple[int, int, int, str]:
        """The fields, in order: ``dataclasses.astuple`` deep-copies each (some 20 calls an edit, at every import)."""
        return self.line, self.start_col, self.end_col, self.text

    def __post_init__(self) -> None:
        if "\n" in self.text:
            raise ValueError("an edit may not add lines: it would shift every line number after it")


@functools.lru_cache(maxsize=4)
def parse(source: str) -> ast.Module:
    """The AST of a torch file; cached, since computing the edits and swapping them in both need it."""
    return ast.parse(source)


@functools.lru_cache(maxsize=4)
def definitions(source: str) -> dict[str, ast.FunctionDef]:
    """The file's module-level functions and class methods by qualified name (``f``, ``Class.f``)."""
    found = {}
    for node in parse(source).body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            found.update({f"{node.name}.{f.name}": f for f in node.body if isinstance(f, ast.FunctionDef)})
    return found


def definition(source: str, relpath: str, name: str) -> ast.FunctionDef:
    """The module-level function or method ``name`` (``f``, ``Class.f``) of the file ``relpath``; ShapeError if none."""
    function = definitions(source).get(name)
    if function is None:
        raise ShapeError(f"{relpath}: no function {name}")
    return function


_COUNTS = {1: "one", 2: "two", 3: "three"}


def find_replaced(
    relpath: str,
    within: ast.AST | Iterable[ast.AST] | None,
    what: str,
    is_it: Callable[[ast.AST], object],
    count: int | None = 1,
) -> list[ast.AST]:
    """What an edit replaces: the nodes under ``within`` (a function of the file ``relpath``, the whole tree, or
    several nodes; None where the file lacks the function) for which ``is_it`` is true, in ``ast.walk`` order.
    There must be ``count`` of them (None: one or more); any other number means the file is not the shape the edit
    was written for, and every fix says so in the same words: ShapeError "RELPATH: expected one WHAT, found N"."""
    roots = [] if within is None else [within] if isinstance(within, ast.AST) else list(within)
    found = [node for root in roots for node in ast.walk(root) if is_it(node)]
    if len(found) != count and not (count is None and found):
        expected = "one or more" if count is None else _COUNTS.get(count, str(count))
        raise ShapeError(f"{relpath}: expected {expected} {what}, found {len(found)}")
    return found


def nested_function(relpath: str, tree: ast.AST, path: list[str]) -> ast.FunctionDef:
    """The function reached by following ``path`` (names of nested defs) from ``tree``, of the file ``relpath``."""
    node = tree
    for name in path:
        (node,) = find_replaced(
            relpath,
            node,
            f"function {name} on the path {'.'.join(path)}",
            lambda child, name=name, outer=node: (
                isinstance(child, ast.FunctionDef) and child.name == name and child is not outer
            ),
        )
    return node


@functools.lru_cache(maxsize=4)
def _encoded_lines(source: str) -> list[bytes]:
    return [line.encode() for line in source.splitlines(keepends=True)]


def segment(source: str, node: ast.AST) -> str:
    """The text of ``node``: ``ast.get_source_segment`` without re-splitting the file on every call."""
    lines = _encoded_lines(source)
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:
        return lines[first][node.col_offset : node.end_col_offset].decode()
    text = lines[first][node.col_offset :] + b"".join(lines[first + 1 : last]) + lines[last][: node.end_col_offset]
    return text.decode()


def replace_node(node: ast.AST, text: str) -> Edit:
    """An edit that replaces a single-line node's text."""
    if node.lineno != node.end_lineno:
        raise ShapeError(f"line {node.lineno}: expected a one-line {type(node).__name__}")
    return Edit(node.lineno, node.col_offset, node.end_col_offset, text)


def insert_at(line: int, col: int, text: str) -> Edit:
    return Edit(line, col, col, text)


def apply_edits(source: str, edits: list[Edit]) -> str:
    lines = source.splitlines(keepends=True)
    by_line: dict[int, list[Edit]] = {}
    for edit in edits:
        by_line.setdefault(edit.line, []).append(edit)
    for line_no, line_edits in by_line.items():
        raw = lines[line_no - 1].encode()
        # Right to left, so earlier columns stay valid while later spans are replaced.
        for edit in sorted(line_edits, key=lambda e: e.start_col, reverse=True):
            raw = raw[: edit.start_col] + edit.text.encode() + raw[edit.end_col :]
        lines[line_no - 1] = raw.decode()
    return "".join(lines)


def unified_diff(relpath: str, old: str, new: str) -> str:
    return "".join(
        difflib.unified_diff(
            old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{relpath}", f"b/{relpath}", n=3
        )
    )


def outermost_function(tree: ast.Module, line: int) -> tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """The module-level function or class method whose text holds ``line``, with its qualified name.

    Only those are reachable as live objects (``module.f`` or ``module.Class.f``); functions nested in
    them are recompiled along with them, since a code object holds its nested code objects.
    """

    def walk(body: list[ast.stmt], prefix: str) -> Iterator[tuple[str, ast.AST]]:
        for node in body:
            if isinstance(node, ast.ClassDef):
                yield from walk(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{prefix}{node.name}", node
            elif isinstance(node, (ast.If, ast.Try)):  # `if TYPE_CHECKING:` / `try: import` blocks
                for field in ("body", "orelse", "finalbody"):
                    yield from walk(getattr(node, field, []), prefix)

    for qualname, node in walk(tree.body, ""):
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        if first <= line <= node.end_lineno:
            return qualname, node
    raise ShapeError(f"line {line} is not inside a module-level function or method")


def nested_functions_around(tree: ast.Module, lines: set[int]) -> set[tuple[str, int]]:
    """``(name, co_firstlineno)`` of every function nested in another whose text holds one of ``lines``.

    Live closures of such a function (a decorator's wrapper, made at import: ``module.f`` is the wrapper
    ``torch.export._trace._log_export_wrapper`` made) keep the code they were made with, so they are
    swapped one by one besides their outer function. One walk of the tree, whatever the number of lines:
    this runs at import."""
    found = set()

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            is_function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if is_function and nested:
                first, last = first_line(child), child.end_lineno or child.lineno
                if any(first <= line <= last for line in lines):
                    found.add((child.name, first))
            visit(child, nested or is_function)

    visit(tree, False)
    return found


def first_line(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """``co_firstlineno`` of the function: its first decorator's line, else the ``def`` line."""
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


def iter_code(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and every code object nested in it."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from iter_code(const)


def unwrap_to_code_of(obj: object, filename: str, line: int | None = None) -> types.FunctionType | None:
    """The plain function behind ``obj`` whose code lives in ``filename`` (and starts at ``line``, if given).

    Follows ``staticmethod``/``classmethod`` and ``functools.wraps`` chains (``__wrapped__``), which
    is how torch's decorators (``contextmanager``, ``lru_cache``, ``_disable_dynamo``) expose it. A
    decorator defined in the same file (``torch.export._trace._log_export_wrapper``) has its wrapper's code
    from the file too: ``line`` tells the decorated function from it.
    """
    seen = 0
    while obj is not None and seen < 16:
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        code = obj.__code__ if isinstance(obj, types.FunctionType) else None
        if code is not None and code.co_filename == filename and line in (None, code.co_firstlineno):
            return obj
        obj = getattr(obj, "__wrapped__", None)
        seen += 1
    return None


def resolve_function(
    module: types.ModuleType, qualname: str, filename: str, line: int | None = None
) -> types.FunctionType:
    owner: object = module
    *path, name = qualname.split(".")
    for part in path:
        owner = vars(owner).get(part) if hasattr(owner, "__dict__") else None
        if owner is None:
            raise ShapeError(f"{module.__name__}.{qualname}: {part} not found in the live module")
    func = unwrap_to_code_of(vars(owner).get(name), filename, line)
    if func is None and line is not None:
        func = unwrap_to_code_of(vars(owner).get(name), filename)  # reported below as "source and module differ"
    if func is None:
        raise ShapeError(f"{module.__name__}.{qualname}: no live function with code from {filename}")
    return func


def live_functions(module: types.ModuleType) -> Iterator[types.FunctionType]:
    """Every function defined in ``module``'s file that is reachable from its namespace or classes."""
    filename = module.__file__
    for value in list(vars(module).values()):
        if isinstance(value, type) and value.__module__ == module.__name__:
            for attr in list(vars(value).values()):
                candidates = [attr.fget, attr.fset, attr.fdel] if isinstance(attr, property) else [attr]
                for candidate in candidates:
                    func = unwrap_to_code_of(candidate, filename)
                    if func is not None:
                        yield func
        else:
            func = unwrap_to_code_of(value, filename)
            if func is not None:
                yield func


def _overlap(a: Edit, b: Edit) -> bool:
    """Whether two edits touch the same text (or insert at the same point: their order would be a guess)."""
    if a.line != b.line:
        return False
    if a.start_col == a.end_col or b.start_col == b.end_col:
        return a.start_col == b.start_col or a.start_col < b.end_col and b.start_col < a.end_col
    return a.start_col < b.end_col and b.start_col < a.end_col


class PatchedFile:
    """Every source patch applied to one live module, compiled together.

    Each patch adds a layer of edits. The edited functions get their code from the file with *all* the
    active layers applied, so two patches of one function (or of one file) compose, in whatever order they
    are applied and removed: removing a layer recompiles the file with the others, and a function no
    layer touches any more gets torch's own code back. Compiling each patch's edits alone would make the
    second patch of a function silently replace the first.

    One instance per module (:meth:`of`), kept while any layer is applied. Every check that can fail runs
    in :meth:`_plan`, before the first ``__code__`` changes.
    """

    _files: ClassVar[dict[str, PatchedFile]] = {}

    def __init__(self, module: types.ModuleType, source: str) -> None:
        self.module, self.source = module, source
        self.layers: dict[object, list[Edit]] = {}  # owner (a patch) -> its edits, in application order
        self.original: dict[types.FunctionType, types.CodeType] = {}  # torch's code of each function swapped
        self.installed: dict[types.FunctionType, types.CodeType] = {}  # the code put there

    @classmethod
    def of(cls, module: types.ModuleType, source: str) -> PatchedFile:
        patched = cls._files.get(module.__name__)
        if patched is None:
            return cls(module, source)
        if patched.module is not module or patched.source != source:
            raise ShapeError(f"{module.__name__}: the module or its file changed since it was first patched")
        return patched

    def add(self, owner: object, edits: list[Edit]) -> Callable[[], None]:
        """Check that ``owner``'s edits compose with the others and compile; return what swaps them in."""
        if owner in self.layers:
            raise ShapeError(f"{self.module.__name__}: this patch is applied already")
        for other_owner, other in self.layers.items():
            clash = next((e for e in edits for o in other if _overlap(e, o)), None)
            if clash is not None:
                raise ShapeError(
                    f"{self.module.__name__} line {clash.line}: edited by {type(other_owner).__name__} already"
                )
        layers = {**self.layers, owner: edits}
        return self._plan(layers)

    def remove(self, owner: object) -> None:
        if owner in self.layers:
            self._plan({k: v for k, v in self.layers.items() if k is not owner})()

    def is_applied(self, owner: object) -> bool:
        return owner in self.layers and all(func.__code__ is code for func, code in self.installed.items())

    def codes_of(self, owner: object) -> set[types.CodeType]:
        """The installed code objects with an instruction on a line that ``owner`` edits: the function around each
        edit, and a lambda or comprehension on that line (edits never add lines, so the file's line numbers are the
        code's)."""
        lines = {edit.line for edit in self.layers.get(owner, ())}
        codes = {nested for top in self.installed.values() for nested in iter_code(top)}
        return {code for code in codes if lines & {line for _start, _end, line in code.co_lines()}}

    def _compile(
        self, edits: list[Edit]
    ) -> tuple[dict[tuple[str, int], types.CodeType], set[tuple[str, int]], set[tuple[str, str, int]]]:
        """The code of the edited functions by (name, first line), the (name, first line) of the edited nested
        functions, and the (qualified name, name, first line) of the module-level functions and methods the edits
        are in. Only the edited functions' code: loading a whole torch file's code back from the cache cost more
        than the rest of a patch's start."""
        filename = self.module.__file__
        tree = parse(self.source)
        try:
            compiled = compile(apply_edits(self.source, edits), filename, "exec", dont_inherit=True)
        except SyntaxError as exc:
            raise ShapeError(f"the edited {filename} does not compile: {exc}") from exc
        nested = nested_functions_around(tree, {e.line for e in edits})
        outermost = {
            (qualname, node.name, first_line(node))
            for qualname, node in (outermost_function(tree, e.line) for e in edits)
        }
        wanted = nested | {(name, line) for _qualname, name, line in outermost}
        codes = {(c.co_name, c.co_firstlineno): c for c in iter_code(compiled)}
        return {key: code for key, code in codes.items() if key in wanted}, nested, outermost

    def _plan(self, layers: dict[object, list[Edit]]) -> Callable[[], None]:
        """The swaps that give every live function the code of the file with ``layers`` applied."""
        module, filename = self.module, self.module.__file__
        edits = [edit for layer in layers.values() for edit in layer]
        # Parsing and compiling a torch file is most of an import's cost: kept between processes (_cache),
        # keyed by the file's path (compiled into the code) and text, and by the edits.
        key = (filename, text_digest(self.source), digest(repr(sorted(e.row() for e in edits))))
        new_codes, nested, outermost = cached("compiled", key, lambda: self._compile(edits))

        target: dict[types.FunctionType, types.CodeType] = {}
        for func in live_functions(module) if nested else ():  # live closures of edited nested functions
            original = self.original.get(func, func.__code__)
            key = (original.co_name, original.co_firstlineno)
            if key in nested and key in new_codes and new_codes[key].co_freevars == original.co_freevars:
                target[func] = new_codes[key]
        for qualname, name, line in outermost:
            func = resolve_function(module, qualname, filename, line)
            original = self.original.get(func, func.__code__)
            if original.co_firstlineno != line:
                raise ShapeError(
                    f"{module.__name__}.{qualname}: the live function starts at line "
                    f"{original.co_firstlineno}, the file at {line}: source and module differ"
                )
            new_code = new_codes[(name, line)]
            if new_code.co_freevars != original.co_freevars:
                raise ShapeError(f"{module.__name__}.{qualname}: the edit changed the function's closure")
            target[func] = new_code

        def swap() -> None:
            for func in list(self.installed):
                if func not in target:  # no layer edits it any more
                    func.__code__ = self.original.pop(func)
                    del self.installed[func]
            for func, code in target.items():
                self.original.setdefault(func, func.__code__)
                func.__code__ = self.installed[func] = code
            self.layers = layers
            if layers:
                self._files[module.__name__] = self
            else:
                self._files.pop(module.__name__, None)

        return swap
