"""The mechanical pass behind docs/torch-2.15-globals.md: process state that torch's Python code writes in functions.

    python docs/survey.py TORCH_DIR [--list] [--scope old]

TORCH_DIR is an installed ``torch`` package (its ``.py`` files are read, nothing is imported). Five kinds of hit,
each a (module, name) pair found in a function:

* ``global``: a ``global X`` declaration and a write of X in that function (assignment, ``del``, augmented
  assignment, or a mutation ``X[k] = ...`` / ``X.append(...)`` ...);
* ``attr``: a store to an attribute of a module-level object, ``Obj.a = ...``, ``Obj.a[k] = ...``, ``del Obj.a``,
  ``setattr(Obj, ...)`` (``cls.a = ...`` in a classmethod counts as its class), or ``self.a = ...`` in a method of a
  class the module makes one instance of at module level (a singleton);
* ``container``: a mutation of a module-level container, ``X[k] = ...``, ``X.append(...)``, ``X.clear()`` ...;
* ``operator``: a write of an operator's Python kernels or dispatch cache (``op.py_kernels[k] = ...``,
  ``op._dispatch_cache.clear()``, ``op.py_impl(k)(fn)`` in a function), whatever object ``op`` is;
* ``switch``: a call of a C++ or process switch: a function named ``set_flags`` or ``_set_*`` / ``set_*`` reached
  through ``torch`` (``torch._C._set_sdp_use_math``, ``torch.backends.cudnn.set_flags``, ...).

Stores to a module-level ``threading.local()`` are listed apart, as ``tls`` (per thread already). A hit is marked
``restore`` when the function writes it again in a ``finally`` (save/set/restore), and ``ctx`` when the function
is a ``@contextmanager`` or an ``__enter__`` / ``__exit__``. It prints the counts (hits and distinct pairs per
kind, and per top-level area), with ``--list`` every hit. ``--scope old`` keeps the packages the first reading
covered, to compare with its 227 declarations / 162 names.
"""

from __future__ import annotations

import argparse
import ast
import collections
from collections.abc import Iterator
from pathlib import Path

OLD_SCOPE = (
    "_dynamo/", "_inductor/", "fx/", "_functorch/", "export/", "_export/", "autograd/", "compiler/",
    "_higher_order_ops/", "utils/checkpoint.py", "nn/attention/", "_subclasses/", "_guards.py", "_library/",
    "_ops.py", "cuda/graphs.py",
)  # fmt: skip
OPERATOR_STATE = {"py_kernels", "_dispatch_cache"}  # an operator's Python kernels: every thread dispatches through them
OPERATOR_CALLS = {"py_impl", "_del_dispatch", "_uncache_dispatch"}
MUTATORS = {"append", "extend", "insert", "add", "update", "pop", "popitem", "remove", "discard", "clear",
            "setdefault", "appendleft", "popleft", "__setitem__", "__delitem__"}  # fmt: skip


def dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of attributes on a name (subscripts dropped), else None."""
    parts = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def bound(statements: list[ast.stmt]) -> set[str]:
    """The names a block binds at its own level (a module body, or a function's body with its nested blocks)."""
    names = set()
    for node in statements:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                names.add(sub.id)
            elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(sub.name)
            elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in sub.names)
            elif isinstance(sub, ast.arg):
                names.add(sub.arg)
    return names


def own(node: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[ast.AST]:
    """The nodes of a function's body, not those of functions, lambdas or classes nested in it (their decorators
    and defaults, which run in this body, are)."""
    todo = list(node.body)
    while todo:
        child = todo.pop()
        yield child
        if isinstance(child, ast.ClassDef):
            todo += [*child.decorator_list, *child.bases]
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            todo += [*child.decorator_list, child.args]
        elif not isinstance(child, ast.Lambda):
            todo += ast.iter_child_nodes(child)


def module_names(tree: ast.Module) -> set[str]:
    """Names bound by the module's top level (also inside top-level if/try/with/for), not inside defs."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        else:
            names |= bound([node])
    return names


def thread_locals(tree: ast.Module) -> set[str]:
    """Module-level names bound to a ``threading.local()`` (or an instance of a subclass the module defines)."""
    local_classes = {"local", "threading.local"} | {
        node.name for node in tree.body
        if isinstance(node, ast.ClassDef) and any(dotted(b) in ("local", "threading.local") for b in node.bases)
    }  # fmt: skip
    return {
        target.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value
        and isinstance(node.value, ast.Call) and dotted(node.value.func) in local_classes
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(target, ast.Name)
    }  # fmt: skip


def singletons(tree: ast.Module) -> dict[str, str]:
    """Classes of the module that it instantiates at module level: class name -> instance name."""
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name):
            if node.value.func.id in classes and isinstance(node.targets[0], ast.Name):
                found[node.value.func.id] = node.targets[0].id
    return found


class Survey(ast.NodeVisitor):
    def __init__(self, module: str, tree: ast.Module) -> None:
        self.module, self.globals, self.singletons = module, module_names(tree), singletons(tree)
        self.thread_locals = thread_locals(tree)
        self.hits: list[tuple[str, str, str, str, int, str]] = []  # kind, module, name, function, line, marks
        self.classes: list[str] = []
        self.enclosing: list[set[str]] = [set()]  # the locals of the functions a nested function is in
        self.visit(tree)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node.name)
        self.generic_visit(node)
        self.classes.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        body = list(own(node))
        declared = {name for sub in body if isinstance(sub, ast.Global) for name in sub.names}
        local = (bound(node.body) | bound([node.args]) | self.enclosing[-1]) - declared
        cls = self.classes[-1] if self.classes else None
        is_ctx = node.name in ("__enter__", "__exit__") or any(
            (dotted(d) or "").endswith("contextmanager") for d in node.decorator_list
        )
        in_finally = {id(sub) for t in body if isinstance(t, ast.Try) for s in t.finalbody for sub in ast.walk(s)}
        written: dict[str, str] = {}

        def hit(kind: str, name: str, at: ast.AST) -> None:
            marks = ("restore " if id(at) in in_finally else "") + ("ctx" if is_ctx else "")
            if kind == "global":
                written[name] = written.get(name, "") + " " + marks
            else:
                self.hits.append((kind, self.module, name, node.name, at.lineno, marks.strip()))

        def store(target: ast.AST, at: ast.AST) -> None:
            name = dotted(target)
            if name is None:
                return
            root, _, rest = name.partition(".")
            if OPERATOR_STATE & set(name.split(".")[1:]):
                hit("operator", name, at)
            elif root in declared:
                hit("global", root, at)
            elif root == "cls" and cls and rest:
                hit("attr", f"{cls}.{rest}", at)
            elif root == "self" and cls in self.singletons and rest and node.name not in ("__init__", "__new__"):
                hit("attr", f"{self.singletons[cls]}.{rest}", at)
            elif root in self.thread_locals and root not in local:
                hit("tls", name, at)
            elif root in self.globals and root not in local:
                hit("attr" if isinstance(target, ast.Attribute) and "." in name else "container", name, at)

        for sub in body:
            if isinstance(sub, (ast.Assign, ast.Delete)):
                targets = sub.targets
            elif isinstance(sub, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor)):
                targets = [sub.target]
            elif isinstance(sub, ast.withitem):
                targets = [sub.optional_vars] if sub.optional_vars else []
            elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute):
                callee, leaf = dotted(sub.func) or "", sub.func.attr
                if leaf in OPERATOR_CALLS:
                    hit("operator", callee or leaf, sub)
                elif leaf in MUTATORS:
                    store(ast.Subscript(value=sub.func.value, slice=ast.Constant(0)), sub)
                elif callee.startswith("torch.") and (leaf == "set_flags" or leaf.startswith(("_set_", "set_"))):
                    hit("switch", callee, sub)
                continue
            elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id == "setattr" and sub.args:
                store(ast.Attribute(value=sub.args[0], attr="*"), sub)
                continue
            else:
                continue
            for target in targets:
                for leaf in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                    store(leaf, leaf)
        for name in sorted(declared):
            marks = written.get(name)
            line = next(sub.lineno for sub in body if isinstance(sub, ast.Global) and name in sub.names)
            flags = "unwritten" if marks is None else " ".join(sorted(set(marks.split())))
            self.hits.append(("global", self.module, name, node.name, line, flags))
        self.enclosing.append(local)
        self.generic_visit(node)
        self.enclosing.pop()

    visit_AsyncFunctionDef = visit_FunctionDef


def survey(torch_dir: Path, scope: tuple[str, ...] = ("",)) -> list[tuple[str, str, str, str, int, str]]:
    hits = []
    for path in sorted(torch_dir.rglob("*.py")):
        rel = path.relative_to(torch_dir).as_posix()
        if rel.startswith(scope):
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"), rel)
            except SyntaxError:  # a test file in a newer Python's syntax
                print(f"not parsed: {rel}")
                continue
            hits += Survey(f"torch/{rel}", tree).hits
    return hits


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("torch_dir", type=Path)
    parser.add_argument("--list", action="store_true", help="print every hit (kind, module, name, function:line)")
    parser.add_argument("--scope", choices=("all", "old"), default="all")
    args = parser.parse_args(argv)
    hits = survey(args.torch_dir, OLD_SCOPE if args.scope == "old" else ("",))
    if args.list:
        for kind, module, name, function, line, marks in hits:
            print(f"{kind}\t{module}\t{name}\t{function}:{line}\t{marks}")
    print("kind       hits  pairs  restore  ctx")
    for kind in ("global", "attr", "container", "operator", "switch", "tls"):
        of = [h for h in hits if h[0] == kind]
        pairs = {h[1:3] for h in of}
        restore = {h[1:3] for h in of if "restore" in h[5]}
        ctx = {h[1:3] for h in of if "ctx" in h[5]}
        print(f"{kind:9} {len(of):5} {len(pairs):6} {len(restore):8} {len(ctx):4}")
    areas = collections.Counter()
    for module, _ in {h[1:3] for h in hits}:
        areas[module.split("/")[1].removesuffix(".py")] += 1
    print("pairs by area:", ", ".join(f"{area} {n}" for area, n in sorted(areas.items(), key=lambda a: -a[1])))


if __name__ == "__main__":
    main()
