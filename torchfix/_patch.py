"""The two kinds of patch a fix is made of: source edits of one module, and module globals made thread-local.

Both compute their edits from the text of the torch file alone (so ``patches/`` can be generated from a
release's source without installing it) and apply them to the live module all-or-nothing: every check
that can fail runs before the first change.
"""

from __future__ import annotations

import ast
import dis
import importlib
import os
import symtable
import threading
import types
from collections.abc import Iterator

from ._source import CodeSwap, Edit, ShapeError, iter_code, live_functions, parse, replace_node

_GLOBAL_OPS = {"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL"}


def read_source(module: types.ModuleType) -> str:
    path = getattr(module, "__file__", None) or ""
    if not path.endswith(".py") or not os.path.exists(path):
        raise ShapeError(f"{module.__name__}: no Python source to patch (module file: {path or 'none'})")
    with open(path, encoding="utf-8") as f:
        return f.read()


class SourcePatch:
    """Edits of one torch module's functions, swapped in by ``__code__``.

    Subclasses say which edits (:meth:`edits`, a pure function of the file's text) and may set up module
    state the edited code needs (:meth:`_install_state` / :meth:`_remove_state`).
    """

    def __init__(self, module: str, relpath: str) -> None:
        self.module_name = module
        self.relpath = relpath  # the file inside a torch source tree, e.g. "torch/fx/_symbolic_trace.py"
        self._module: types.ModuleType | None = None
        self._swap: CodeSwap | None = None

    def edits(self, source: str) -> list[Edit]:
        raise NotImplementedError

    def describe(self) -> str:
        """One line for the diff header: what the patch does beyond the text edits."""
        return f"{self.relpath}: the edited functions' code is swapped in place (__code__)"

    def apply(self) -> None:
        module = importlib.import_module(self.module_name)
        source = read_source(module)
        swap = CodeSwap.prepare(module, source, self.edits(source))
        self._install_state(module)
        swap.apply()
        self._module, self._swap = module, swap

    def revert(self) -> None:
        if self._swap is None:
            return
        self._swap.revert()
        self._remove_state(self._module)
        self._module = self._swap = None

    def verify(self) -> None:
        if self._swap is None or not self._swap.is_applied():
            raise ShapeError(f"{self.module_name}: patched code is not in place")

    def _install_state(self, module: types.ModuleType) -> None:
        pass

    def _remove_state(self, module: types.ModuleType) -> None:
        pass


def _module_level_names(source: str) -> set[str]:
    """Names the module body assigns (``x = ...``, ``x: T = ...``), as the file defines its globals."""
    names = set()
    for node in parse(source).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(target.id for target in targets if isinstance(target, ast.Name))
    return names


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


def _thread_local_class(holder: str, defaults: dict[str, object]) -> type[threading.local]:
    # Class attributes are the per-thread defaults: a new thread reads them until it sets its own.
    return type(holder, (threading.local,), dict(defaults))


class ThreadLocalGlobals(SourcePatch):
    """Make module globals per-thread: ``module.NAME`` becomes ``module.HOLDER.ATTR``.

    * Functions of the module that read or write ``NAME`` (``LOAD_GLOBAL``/``STORE_GLOBAL``) are
      rewritten to use the attribute of a ``threading.local`` stored in the module as ``HOLDER``.
    * Other modules that use ``module.NAME`` (``LOAD_ATTR``/``STORE_ATTR``) go through a property of
      the same name on a ``ModuleType`` subclass that the module is switched to.
    * ``NAME`` leaves the module dict, so any access we missed fails loudly instead of reading a
      stale shared value; :meth:`verify` scans every code object of the module with ``dis`` to prove
      none is left.
    """

    def __init__(
        self, module: str, relpath: str, holder: str, attrs: dict[str, str], optional: frozenset[str] = frozenset()
    ) -> None:
        super().__init__(module, relpath)
        self.holder = holder
        self.attrs = attrs  # global name -> attribute of the thread-local holder
        # Names some releases do not have yet (torch adds flags over time): moved where the file defines them.
        self.optional = optional
        self._saved_class: type | None = None
        self._moved: dict[str, str] = {}  # the attrs moved in the live module

    def _present(self, defined: object) -> dict[str, str]:
        return {name: attr for name, attr in self.attrs.items() if name not in self.optional or name in defined}

    def edits(self, source: str) -> list[Edit]:
        edits = []
        for name, attr in self._present(_module_level_names(source)).items():
            uses, declarations = _global_uses(source, self.relpath, name)
            if not uses:
                raise ShapeError(f"{self.relpath}: no function uses the global {name}")
            edits += [replace_node(use, f"{self.holder}.{attr}") for use in uses]
            edits += [self._drop_declaration(source, decl, name) for decl in declarations]
        return edits

    def describe(self) -> str:
        moved = ", ".join(f"{name} -> {self.holder}.{attr}" for name, attr in self.attrs.items())
        where = f" ({', '.join(sorted(self.optional))} only where the file defines them)" if self.optional else ""
        return (
            f"{self.relpath}: module globals moved to a threading.local ({moved}){where}; "
            f"`{self.module_name}.<name>` from other modules goes through a property of the same name"
        )

    def _drop_declaration(self, source: str, decl: ast.Global, name: str) -> Edit:
        others = [n for n in decl.names if n != name]
        if others:
            return replace_node(decl, "global " + ", ".join(others))
        line = source.splitlines()[decl.lineno - 1].encode()
        alone = line[: decl.col_offset].strip() == b"" and line[decl.end_col_offset :].strip() == b""
        # A comment keeps the line (line numbers must not move) and tells the reader where it went.
        return replace_node(decl, f"# {name} is thread-local: {self.holder}.{self.attrs[name]}" if alone else "pass")

    def _install_state(self, module: types.ModuleType) -> None:
        namespace = vars(module)
        moved = self._present(namespace)
        missing = [name for name in moved if name not in namespace]
        if missing or self.holder in namespace:
            raise ShapeError(f"{module.__name__}: expected globals {missing} and no {self.holder}")
        defaults = {attr: namespace[name] for name, attr in moved.items()}
        namespace[self.holder] = _thread_local_class(self.holder, defaults)()
        self._saved_class = type(module)
        module.__class__ = type(
            "ModuleWithThreadLocals",
            (type(module),),
            {name: _holder_property(self.holder, attr) for name, attr in moved.items()},
        )
        for name in moved:
            del namespace[name]
        self._moved = moved

    def _remove_state(self, module: types.ModuleType) -> None:
        namespace = vars(module)
        holder = namespace.pop(self.holder)
        # The calling thread's values become the shared globals again.
        for name, attr in self._moved.items():
            namespace[name] = getattr(holder, attr)
        module.__class__ = self._saved_class
        self._moved = {}

    def verify(self) -> None:
        super().verify()
        module = self._module
        left = [
            f"{code.co_qualname if hasattr(code, 'co_qualname') else code.co_name}: {ins.opname} {ins.argval}"
            for func in live_functions(module)
            for code in iter_code(func.__code__)
            if not self.attrs.keys().isdisjoint(code.co_names)  # disassemble only code that names them
            for ins in dis.get_instructions(code)
            if ins.opname in _GLOBAL_OPS and ins.argval in self._moved
        ]
        if left:
            raise ShapeError(f"{module.__name__}: global access left after patching: {', '.join(left)}")
        if any(name in vars(module) for name in self._moved):
            raise ShapeError(f"{module.__name__}: a global came back into the module dict")
        self._verify_per_thread(module)

    def _verify_per_thread(self, module: types.ModuleType) -> None:
        """Behaviour, not just bytecode: a value set through ``module.NAME`` in another thread stays there."""
        mine = {name: getattr(module, name) for name in self._moved}
        seen_elsewhere: dict[str, object] = {}

        def other_thread() -> None:
            for name in self._moved:
                setattr(module, name, not mine[name])
                seen_elsewhere[name] = getattr(vars(module)[self.holder], self._moved[name])

        thread = threading.Thread(target=other_thread, name="torchfix-verify")
        thread.start()
        thread.join()
        if seen_elsewhere != {name: not value for name, value in mine.items()} or any(
            getattr(module, name) != value for name, value in mine.items()
        ):
            raise ShapeError(f"{module.__name__}: {', '.join(self._moved)} did not behave per-thread after patching")


def _holder_property(holder: str, attr: str) -> property:
    def get(module: types.ModuleType) -> object:
        return getattr(vars(module)[holder], attr)

    def set_(module: types.ModuleType, value: object) -> None:
        setattr(vars(module)[holder], attr, value)

    return property(get, set_)


def nested_function(tree: ast.AST, path: list[str]) -> ast.FunctionDef:
    """The function reached by following ``path`` (names of nested defs) from ``tree``."""
    node = tree
    for name in path:
        found = [
            child
            for child in ast.walk(node)
            if isinstance(child, ast.FunctionDef) and child.name == name and child is not node
        ]
        if len(found) != 1:
            raise ShapeError(f"expected one function {name!r} on the path {'.'.join(path)}, found {len(found)}")
        node = found[0]
    return node
