"""A torch we do not know (version, source, missing file) gets one clear warning per fix and an untouched torch;
strict mode raises.

Generated for every fix that applies here: a torch version outside its releases, and a changed copy of the last
file it edits (so that its earlier patches were applied and must be undone). Each case runs in one fresh
interpreter that checks every fix at once; a few hand-written cases follow (a source that differs in shape, a
missing source, TORCHFIX_DISABLE).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
from conftest import FIXES, HAS_H1, TORCH_VERSION, run_ok, run_python

# One pytest-xdist worker runs this file: its interpreters that check every fix at once (the plan, the unknown
# versions, the broken files) run once, not once per worker.
pytestmark = pytest.mark.xdist_group("bad-torch")

PRELUDE = """
import atexit, importlib, importlib.machinery, importlib.util, inspect, json, os, pathlib, py_compile, shutil, sys
import tempfile, types, warnings
SITE = pathlib.Path(importlib.util.find_spec("torch").submodule_search_locations[0]).parent
TMP = pathlib.Path(tempfile.mkdtemp())
atexit.register(shutil.rmtree, TMP)

def redirect(module, relpath, edit=None, sourceless=False):
    # Load torch's `module` (its file: `relpath`, "torch/...") from a copy, edited by `edit`, or compiled only.
    source = (SITE / relpath).read_text()
    path = TMP / relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(edit(source) if edit else source)
    if sourceless:
        path = pathlib.Path(py_compile.compile(str(path), cfile=str(path) + "c"))
    class Finder:
        def find_spec(self, fullname, path_=None, target=None):
            if fullname != module:
                return None
            loader = (importlib.machinery.SourcelessFileLoader if sourceless
                      else importlib.machinery.SourceFileLoader)(fullname, str(path))
            # A package (torch.compiler) keeps finding its submodules in torch.
            package = [str((SITE / relpath).parent)] if relpath.endswith("__init__.py") else None
            return importlib.util.spec_from_file_location(
                fullname, str(path), loader=loader, submodule_search_locations=package)
    sys.meta_path.insert(0, Finder())
    return path
"""

# What torchfix would change in torch: every module its patches name, each function's code and keyword defaults,
# the module's names, its config defaults. Taken before `import torchfix`; the report lists what differs.
SNAPSHOT = """
def functions(module):
    for key, value in list(vars(module).items()):
        members = vars(value).items() if isinstance(value, type) and value.__module__ == module.__name__ else ()
        for name, obj in [(key, value), *((f"{key}.{k}", v) for k, v in members)]:
            if isinstance(obj, property):
                obj = obj.fget
            for depth in range(8):  # the wrapper and what it wraps (`functools.wraps`): either may be patched
                obj = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
                if isinstance(obj, types.FunctionType):
                    yield f"{name}#{depth}", obj
                try:
                    obj = inspect.getattr_static(obj, "__wrapped__")
                except AttributeError:
                    break

def snapshot(names):
    found = {}
    for name in names:
        module = sys.modules.get(name)
        if module is not None:
            found[name] = (
                {key for key, value in vars(module).items() if not isinstance(value, types.ModuleType)},
                {key: (f, f.__code__, dict(f.__kwdefaults__ or {})) for key, f in functions(module)},
                {key: entry.default for key, entry in getattr(module, "_config", {}).items()},
            )
    return found

def outcome(before, caught):
    # What the fixes did, as torchfix reports it and as torch shows it; then uninstall() and what it left.
    import torchfix
    found = {
        "states": {s.name: [s.state.value, s.reason] for s in torchfix.status()},
        "warnings": [str(w.message) for w in caught if w.category is torchfix.TorchfixWarning],
        "changed": changes(before),
    }
    torchfix.uninstall()
    found["left"] = changes(before)  # what uninstall() cannot undo: the remains of a fix refused half-way
    return found

def changes(before):
    found = []
    for name, (keys, codes, config) in snapshot(before).items():
        old_keys, old_codes, old_config = before[name]
        found += [f"{name}: {key} added" for key in keys - old_keys]
        found += [f"{name}: {key} removed" for key in old_keys - keys]
        found += [f"{name}: {key} code" for key, (f, code, _) in old_codes.items() if f.__code__ is not code]
        found += [f"{name}: {key} defaults" for key, (f, _, kw) in old_codes.items() if (f.__kwdefaults__ or {}) != kw]
        found += [f"{name}: config {key} default" for key, value in old_config.items() if config.get(key) != value]
    return found
"""

# The normal run: each fix's state on this torch, the modules its patches name, and the files they edit.
PLAN = """
import json
import torch, torchfix
from torchfix import fixes
from torchfix.__main__ import _installed_reader, _load_triggers
from torchfix._install import module_file_exists
_load_triggers()
here, states = str(torch.__version__), {s.name: s.state.value for s in torchfix.status()}
plan = {}
for fix in fixes.ALL:
    patches = fix.patches(here) if states[fix.name] == "applied" else []
    modules = [p.module_name for p in patches]
    plan[fix.name] = dict(
        state=states[fix.name],
        # What to import before torchfix, so that every fix is applied (or not) at once, as here: none is left
        # "pending import" (a patch may name a module this torch lacks).
        imports=sorted(m for m in {fix.trigger, *modules} if module_file_exists(m)),
        modules=modules,
        # [module, file] of each patch that edits a file here, in the order the fix applies them.
        files=[[p.module_name, p.relpath] for p in patches if hasattr(p, "relpath") and p.diff(_installed_reader)],
    )
print(json.dumps(plan))
"""

# One case: `setup` runs before torch is imported, `after_import` once every module the fixes patch is.
CASE = """
PLAN = {plan!r}
{setup}
import torch
for name in sorted({{m for fix in PLAN.values() for m in fix["imports"]}}):
    importlib.import_module(name)  # so that every fix applies at `import torchfix`
{after_import}
before = snapshot({{m for fix in PLAN.values() for m in fix["modules"]}})
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torchfix
report = outcome(before, caught)
{after_report}
print(json.dumps(report))
"""


@functools.cache
def plan() -> dict[str, dict]:
    return run_ok(PLAN, forked="triggers").json()


def applied_here(fix: str) -> dict:
    found = plan()[fix]
    if found["state"] != "applied":
        pytest.skip(f"{fix} is {found['state']} on this torch: nothing to refuse")
    return found


def case(setup: str = "", after_import: str = "", after_report: str = "") -> dict:
    body = CASE.format(plan=plan(), setup=setup, after_import=after_import, after_report=after_report)
    return run_ok(PRELUDE + SNAPSHOT + body).json()


NAMES = [fix["name"] for fix in FIXES]
COSTS_TIME_ONLY = {fix["name"] for fix in FIXES if fix["cost"]}  # no warning (nor error) where they cannot apply


def assert_refused(fix: str, report: dict, reason: str) -> None:
    """``fix`` is "unsupported" with ``reason``, warned about once, and left nothing behind in the modules it
    patches (once the fixes that did apply are uninstalled)."""
    state, why = report["states"][fix]
    assert state == "unsupported" and reason in why, (fix, state, why)
    about_it = [w for w in report["warnings"] if w.startswith(f"torchfix: {fix} ")]
    assert len(about_it) == (0 if fix in COSTS_TIME_ONLY else 1), report["warnings"]
    assert all(f"{fix} not applied" in w and why in w for w in about_it), about_it
    left = [change for change in report["left"] if change.split(":")[0] in plan()[fix]["modules"]]
    assert not left, left


VERSIONS = ("2.99.0", "not-a-version")

# After the first version (set before `import torchfix`), the second one, installed again; then every fix again,
# one at a time, in strict mode: install() must raise for it.
SECOND_VERSION_AND_STRICT = f"""
torch.__version__ = {VERSIONS[1]!r}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torchfix.install()
report[{VERSIONS[1]!r}] = outcome(before, caught)
os.environ["TORCHFIX_STRICT"] = "1"
report["strict"] = {{}}
from torchfix import fixes
for fix in fixes.ALL:
    os.environ["TORCHFIX_DISABLE"] = ",".join(other.name for other in fixes.ALL if other is not fix)
    torchfix.uninstall()
    try:
        torchfix.install()
        report["strict"][fix.name] = None
    except torchfix.TorchfixError as exc:
        report["strict"][fix.name] = str(exc)
"""


@functools.cache
def unknown_versions() -> dict:
    return case(after_import=f"torch.__version__ = {VERSIONS[0]!r}", after_report=SECOND_VERSION_AND_STRICT)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("fix", NAMES)
def test_a_torch_version_outside_the_fix_releases_patches_nothing(fix, version):
    applied_here(fix)
    run = unknown_versions()
    report = run if version == VERSIONS[0] else run[version]
    assert_refused(fix, report, "outside the releases")
    assert report["changed"] == [], report["changed"]  # no fix applied anything: torch is untouched
    strict = run["strict"][fix]
    if fix in COSTS_TIME_ONLY:
        assert strict is None
    else:
        assert strict is not None and f"{fix} not applied" in strict, strict


@functools.cache
def broken_file_runs() -> list[list[str]]:
    """The fixes whose last edited file one interpreter breaks together: none of them has another of its files
    broken there (its earlier patches must apply, then be undone). Fixes share files, so a few runs."""
    runs: list[list[str]] = []
    for name, fix in plan().items():
        if fix["state"] != "applied" or not fix["files"]:
            continue
        last, earlier = fix["files"][-1][1], {relpath for _, relpath in fix["files"][:-1]}
        for run in runs:
            broken = {plan()[other]["files"][-1][1] for other in run}
            earlier_in_run = {relpath for other in run for _, relpath in plan()[other]["files"][:-1]}
            if last not in earlier_in_run and not earlier & broken:
                run.append(name)
                break
        else:
            runs.append([name])
    return runs


@functools.cache
def broken_run(fixes: tuple[str, ...]) -> dict:
    broken = {tuple(plan()[fix]["files"][-1]) for fix in fixes}
    setup = "".join(f"redirect({module!r}, {relpath!r})\n" for module, relpath in sorted(broken))
    # One more line at the top, after the import: the file and the live module differ by one line.
    after_import = "".join(
        f"(TMP / {relpath!r}).write_text('# one more line\\n' + (TMP / {relpath!r}).read_text())\n"
        for _, relpath in sorted(broken)
    )
    report = case(setup, after_import)
    report["broken"] = sorted(relpath for _, relpath in broken)
    return report


@pytest.mark.parametrize("fix", NAMES)
def test_a_changed_file_leaves_the_whole_fix_out_and_the_other_fixes_in(fix):
    found = applied_here(fix)
    if not found["files"]:
        pytest.skip(f"{fix} edits no file of this torch (it changes defaults only)")
    report = broken_run(tuple(next(run for run in broken_file_runs() if fix in run)))
    assert_refused(fix, report, "source and module differ")
    # A fix that edits none of the broken files is as it is in a normal run.
    for other, normal in plan().items():
        if not {relpath for _, relpath in normal["files"]} & set(report["broken"]):
            assert report["states"][other][0] == normal["state"], (other, report["states"][other])


@dataclass(frozen=True)
class Subject:
    """A fix, the module and file of its first patch, the global it moves and a function it rewrites."""

    fix: str
    module: str
    relpath: str
    flag: str
    holder: str
    rewritten: str  # a function the fix rewrites (its code must be the original after a refusal)

    def __str__(self) -> str:
        return self.fix


FX = Subject(
    "fx-tracing-flag", "torch.fx._symbolic_trace", "torch/fx/_symbolic_trace.py", "_is_fx_tracing_flag",
    "_is_fx_tracing_tls", "torch.fx._symbolic_trace.is_fx_tracing",
)  # fmt: skip
COMPILER = Subject(
    "compiler-flags", "torch.compiler", "torch/compiler/__init__.py", "_is_compiling_flag",
    "_compiler_flags_tls", "torch.compiler.is_compiling",
)  # fmt: skip
SUBJECTS = [subject for subject, has in ((FX, HAS_H1), (COMPILER, TORCH_VERSION.release >= (2, 3))) if has]
per_subject = pytest.mark.parametrize("subject", SUBJECTS, ids=str)

REPORT = """
import torch
import {module} as module
rewritten = {rewritten}
code = rewritten.__code__
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torchfix
status = next(s for s in torchfix.status() if s.name == {fix!r})
print(json.dumps({{
    "states": {{status.name: [status.state.value, status.reason]}},
    "warnings": [str(w.message) for w in caught if w.category is torchfix.TorchfixWarning],
    # Nothing of this fix (other fixes may patch the same module, and may have been applied).
    "untouched": {flag!r} in vars(module) and {holder!r} not in vars(module) and rewritten.__code__ is code,
}}))
"""


def outcome(subject: Subject, setup: str) -> dict:
    return run_ok(PRELUDE + setup + REPORT.format(**vars(subject))).json()


def redirect(subject: Subject, **options: str) -> str:
    """PRELUDE code loading the subject's first module from a copy (``edit``/``sourceless`` as there)."""
    extra = "".join(f", {name}={value}" for name, value in options.items())
    return f"redirect({subject.module!r}, {subject.relpath!r}{extra})\n"


def assert_subject_refused(subject: Subject, result: dict, reason: str) -> None:
    state, why = result["states"][subject.fix]
    assert state == "unsupported" and reason in why, result
    assert result["untouched"], result
    about_this_fix = [w for w in result["warnings"] if w.startswith(f"torchfix: {subject.fix} ")]
    assert len(about_this_fix) == 1 and f"{subject.fix} not applied" in about_this_fix[0], result


@per_subject
def test_source_that_differs_in_shape(subject):
    flag = subject.flag
    edit = f"lambda s: s + '\\n\\ndef _reset():\\n    global {flag}\\n    del {flag}\\n'"
    assert_subject_refused(subject, outcome(subject, redirect(subject, edit=edit)), f"del {flag}")


@per_subject
def test_source_file_missing(subject):
    assert_subject_refused(subject, outcome(subject, redirect(subject, sourceless="True")), "no Python source")


@pytest.mark.skipif(COMPILER not in SUBJECTS, reason="torch.compiler has its flags from torch 2.3")
def test_a_writer_through_an_alias_is_refused():
    # compiler-flags rewrites torch's writes of `torch.compiler._is_compiling_flag` in other modules; one written
    # through an alias cannot be followed, so the fix refuses (its torch.compiler patch, applied first, is undone).
    alias = "'\\n\\ndef _aliased():\\n    import torch.compiler as c\\n    c._is_compiling_flag = True\\n'"
    setup = f"redirect('torch._export.utils', 'torch/_export/utils.py', edit=lambda s: s + {alias})\n"
    assert_subject_refused(COMPILER, outcome(COMPILER, setup), "is not torch.compiler")


def test_strict_mode_raises_at_import():
    ran = run_python(
        PRELUDE + "import torch\ntorch.__version__ = '2.99.0'\nimport torchfix\n", env={"TORCHFIX_STRICT": "1"}
    )
    assert ran.returncode != 0
    assert "TorchfixError" in ran.stderr and "outside the releases" in ran.stderr, ran.stderr


@pytest.mark.parametrize("value", ["1", "all", "two fixes", "0"])
def test_disable_switch(value):
    off = {"1": NAMES, "all": NAMES, "two fixes": NAMES[:2], "0": []}[value]
    states = run_ok(
        "import json, torch, torchfix\nprint(json.dumps({s.name: s.state.value for s in torchfix.status()}))",
        disable=",".join(off) if value == "two fixes" else value,
        forked="torch",
    ).json()
    assert [name for name, state in states.items() if state == "disabled"] == off, states


def test_disable_switch_with_an_unknown_name_warns_and_keeps_the_rest():
    result = run_ok(
        "import warnings, json\nwarnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    import torch, torchfix\n"
        "print(json.dumps({'states': {s.name: s.state.value for s in torchfix.status()},"
        " 'warnings': [str(w.message) for w in caught]}))",
        disable=f"{NAMES[0]},no-such-fix",
        forked="torch",
    ).json()
    assert result["states"][NAMES[0]] == "disabled"
    assert "disabled" not in [state for name, state in result["states"].items() if name != NAMES[0]]
    assert any("no-such-fix" in w for w in result["warnings"]), result
