"""Patches of one function and of one file compose, in any order of applying and reverting them.

Each runs in a fresh interpreter: the patched modules must not leak into other tests.
"""

import pytest
from conftest import HAS_H1, TORCH_VERSION, run_ok

# A module of its own (no torch state involved) and two patches of its one function: one edits the
# first return value, the other the second. Before patches stacked, the second compiled the file with
# its own edit only, so applying it silently undid the first, and its verify() still passed.
TWO_PATCHES_ON_ONE_FUNCTION = """
import ast, json, pathlib, shutil, sys, tempfile
folder = pathlib.Path(tempfile.mkdtemp())
(folder / "stacked.py").write_text("def pair():\\n    return ('first', 'second')\\n\\ndef other():\\n    return 1\\n")
sys.path.insert(0, str(folder))
import stacked
from torchfix.patching.patches import SourcePatch
from torchfix.patching.source import parse, replace_node

class Replace(SourcePatch):
    def __init__(self, function, index, text):
        super().__init__("stacked", "stacked.py")
        self.function, self.index, self.text = function, index, text
    def edits(self, source):
        func = next(n for n in parse(source).body if getattr(n, "name", None) == self.function)
        value = func.body[0].value
        node = value.elts[self.index] if isinstance(value, ast.Tuple) else value
        return [replace_node(node, self.text)]

a, b, c = Replace("pair", 0, "'A'"), Replace("pair", 1, "'B'"), Replace("other", 0, "2")
original = stacked.pair.__code__
seen = dict()
for patch in {order}:
    patch.apply()
    patch.verify()
seen["applied"] = [stacked.pair(), stacked.other()]
{revert}.revert()
seen["one_reverted"] = [stacked.pair(), stacked.other()]
for patch in (a, b, c):
    patch.revert()
seen["all_reverted"] = [stacked.pair(), stacked.other(), stacked.pair.__code__ is original]
clash = Replace("pair", 0, "'X'")
a.apply()
try:
    clash.apply()
except Exception as exc:
    seen["clash"] = type(exc).__name__
seen["after_clash"] = stacked.pair()
print(json.dumps(seen))
shutil.rmtree(folder)
"""


@pytest.mark.parametrize(
    "order, revert, after_one",
    [
        ("(a, b, c)", "a", [["first", "B"], 2]),
        ("(b, a, c)", "b", [["A", "second"], 2]),
        ("(c, a, b)", "c", [["A", "B"], 1]),
    ],
    ids=["revert-first-applied", "revert-first-applied-other-order", "revert-other-function"],
)
def test_two_patches_of_one_function_compose(order, revert, after_one):
    seen = run_ok(TWO_PATCHES_ON_ONE_FUNCTION.format(order=order, revert=revert)).json()
    assert seen == {
        "applied": [["A", "B"], 2],
        "one_reverted": after_one,
        "all_reverted": [["first", "second"], 1, True],
        "clash": "ShapeError",  # two patches may not edit the same text
        "after_clash": ["A", "second"],  # and the refused one changed nothing
    }


@pytest.mark.skipif(
    not HAS_H1 or TORCH_VERSION.release < (2, 5),
    reason="needs a torch where both fixes move globals of torch.fx._symbolic_trace (CURRENT_PATCHER: 2.5+)",
)
def test_two_fixes_of_one_file_revert_in_either_order():
    # fx-tracing-flag and trace-patch-isolation both move globals of torch.fx._symbolic_trace to
    # per-thread holders, served to other modules by one module __getattr__ (while one is out of the module's dict).
    ran = run_ok(
        """
import json
import torch
import torch.fx._symbolic_trace as st
from torchfix import fixes
from torchfix._fix import revert_all
by_name = {fix.name: fix for fix in fixes.ALL}
version = str(torch.__version__)
original = st.Tracer.trace.__code__, st.is_fx_tracing.__code__
seen = dict()
flag_status, flag_patches = by_name["fx-tracing-flag"].apply(version)
iso_status, iso_patches = by_name["trace-patch-isolation"].apply(version)
seen["states"] = [flag_status.state.value, iso_status.state.value]
revert_all(flag_patches)  # the first applied goes first
seen["flag_back"] = "_is_fx_tracing_flag" in vars(st) and "_is_fx_tracing_tls" not in vars(st)
# The fix that stays still serves CURRENT_PATCHER per thread: from its holder, through the module __getattr__
# while this thread holds a value of its own.
probe = object()
st._current_patcher_tls.patcher = probe
seen["isolation_kept"] = "_thread_patches" in vars(st) and st.CURRENT_PATCHER is probe
st._current_patcher_tls.patcher = None
for patch in iso_patches:
    patch.verify()
revert_all(iso_patches)
seen["restored"] = (st.Tracer.trace.__code__, st.is_fx_tracing.__code__) == original
seen["no_getattr"] = "__getattr__" not in vars(st) and "CURRENT_PATCHER" in vars(st)
print(json.dumps(seen))
""",
        disable="1",
    ).json()
    assert ran == {
        "states": ["applied", "applied"],
        "flag_back": True,
        "isolation_kept": True,
        "restored": True,
        "no_getattr": True,
    }


# A decorator defined in the patched file itself (torch.export._trace._log_export_wrapper): the module
# attribute is the wrapper made at import, a closure of the file's own code. An edit of the wrapper's body
# must reach that live closure (swapped besides its outer function), and an edit of the decorated
# function must reach it, not the wrapper that also comes from the file.
SAME_FILE_DECORATOR = """
import json, pathlib, shutil, sys, tempfile
folder = pathlib.Path(tempfile.mkdtemp())
(folder / "decorated.py").write_text('''import functools

def logged(fn):
    @functools.wraps(fn)
    def wrapper(*args):
        return ("wrapped", fn(*args))
    return wrapper

@logged
def work(x):
    return x + 1
''')
sys.path.insert(0, str(folder))
import decorated
from torchfix.patching.patches import SourcePatch
from torchfix.patching.source import parse, replace_node
import ast

class Edit(SourcePatch):
    def __init__(self, text_from, text_to):
        super().__init__("decorated", "decorated.py")
        self.text_from, self.text_to = text_from, text_to
    def edits(self, source):
        return [replace_node(n, self.text_to) for n in ast.walk(parse(source))
                if isinstance(n, ast.Constant) and n.value == self.text_from]

inner = Edit("wrapped", "'WRAPPED'")
seen = {"before": decorated.work(1)}
inner.apply(); inner.verify()
seen["wrapper_edited"] = decorated.work(1)
inner.revert()
seen["reverted"] = decorated.work(1)
class BodyEdit(SourcePatch):
    def __init__(self):
        super().__init__("decorated", "decorated.py")
    def edits(self, source):
        work = next(n for n in parse(source).body if getattr(n, "name", None) == "work")
        return [replace_node(work.body[0].value, "x + 100")]
body = BodyEdit()
body.apply(); body.verify()
seen["body_edited"] = decorated.work(1)
body.revert()
seen["body_reverted"] = decorated.work(1)
print(json.dumps(seen))
shutil.rmtree(folder)
"""


def test_a_decorator_of_the_same_file_is_patched_in_its_live_wrapper_and_through_it():
    seen = __import__("json").loads(run_ok(SAME_FILE_DECORATOR).stdout)
    assert seen == {
        "before": ["wrapped", 2],
        "wrapper_edited": ["WRAPPED", 2],
        "reverted": ["wrapped", 2],
        "body_edited": ["wrapped", 101],
        "body_reverted": ["wrapped", 2],
    }, seen


# A module's moved globals are in its dict while no thread holds a value of its own, and the module has torchfix's
# __getattr__ only while one does: CPython specialises no attribute read of a module with a __getattr__
# (torch.compiler.is_exporting, read on every compiled call). A direct read answers for the calling thread either way.
MODULE_GETATTR_WHILE_HELD = """
import json, threading
import torch, torchfix
from torchfix.fixes import compiler_flags as fix
module = torch.compiler
holder = vars(module)[fix.HOLDER]

def looks():  # (torchfix's __getattr__ in the module, the flag in the module's dict)
    served = getattr(vars(module).get("__getattr__"), "__module__", "").startswith("torchfix")
    return [served, vars(module).get("_is_compiling_flag", "not in the dict")]

seen = {"idle": looks()}
held, release = threading.Event(), threading.Event()
def hold():
    holder.is_compiling = True  # as Dynamo's tracing sets it
    seen["holder's own read"] = module._is_compiling_flag
    held.set()
    release.wait(30)
    holder.is_compiling = False
thread = threading.Thread(target=hold)
thread.start()
held.wait(30)
seen["held"] = [*looks(), module._is_compiling_flag]
release.set()
thread.join(30)
seen["released"] = looks()
torchfix.uninstall()
seen["uninstalled"] = [looks(), fix.HOLDER in vars(module)]
print(json.dumps(seen))
"""


@pytest.mark.skipif(TORCH_VERSION.release < (2, 3), reason="torch.compiler's flags are globals from torch 2.3")
def test_moved_globals_stay_in_the_module_dict_while_no_thread_holds_its_own():
    assert run_ok(MODULE_GETATTR_WHILE_HELD, forked="torch").json() == {
        "idle": [False, False],
        "holder's own read": True,
        "held": [True, "not in the dict", False],
        "released": [False, False],
        "uninstalled": [[False, False], False],
    }


# A patch that fails while it moves a module's globals leaves the module as it was: the globals back in its dict, no
# holder, no __getattr__. (Here the value a global holds at the install cannot be compared with its default.)
MOVE_REFUSED = """
import json, pathlib, shutil, sys, tempfile
folder = pathlib.Path(tempfile.mkdtemp())
(folder / "moved.py").write_text("FLAG = False\\n\\ndef read():\\n    return FLAG\\n")
sys.path.insert(0, str(folder))
import torch, moved
from torchfix.patching.patches import ThreadLocalGlobals

class Uncomparable:
    def __ne__(self, other):
        raise RuntimeError("cannot compare")

stuck = moved.FLAG = Uncomparable()  # set before the install: the installing thread's own value
before = dict(vars(moved))
patch = ThreadLocalGlobals("moved", "moved.py", "_moved_tls", {"FLAG": "flag"}, seen_in_backward=True)
try:
    patch.apply()
    error = None
except RuntimeError as exc:
    error = str(exc)
print(json.dumps({"error": error, "module as before": vars(moved) == before, "reads": moved.read() is stuck}))
shutil.rmtree(folder)
"""


def test_a_move_that_fails_leaves_the_module_as_it_was():
    assert run_ok(MOVE_REFUSED, forked="torch").json() == {
        "error": "cannot compare",
        "module as before": True,
        "reads": True,
    }
