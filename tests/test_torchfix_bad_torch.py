"""A torch we do not know (version, source, missing file) gets one clear warning and an untouched torch;
strict mode raises. Every case runs in a fresh interpreter, for each subject fix this torch has: the FX
flag (torch 2.0 - 2.13) and the compiler flags (2.3 - 2.15), so the newest releases are covered too."""

from dataclasses import dataclass

import pytest
from conftest import HAS_H1, TORCH_VERSION, run_ok, run_python


@dataclass(frozen=True)
class Subject:
    """A fix, the module and file of its first patch, the global it moves and the function it rewrites."""

    fix: str
    module: str
    relpath: str  # under torch/
    flag: str
    holder: str
    rewritten: str  # a function the fix rewrites (its code must be the original after a refusal)
    break_later_patch: str  # PRELUDE code that breaks a later patch of the same fix, and the reason's word
    later_reason: str

    def __str__(self) -> str:
        return self.fix


FX = Subject(
    "fx-tracing-flag", "torch.fx._symbolic_trace", "fx/_symbolic_trace.py", "_is_fx_tracing_flag",
    "_is_fx_tracing_tls", "torch.fx._symbolic_trace.is_fx_tracing",
    # The checkpoint part comes after the FX-flag part. (Renaming the function that holds the recompute
    # closure hides it in every release's shape.)
    "redirect('torch.utils.checkpoint', 'utils/checkpoint.py', "
    "edit=lambda s: s.replace('_checkpoint_without_reentrant', '_ckpt_no_reentrant'))",
    "checkpoint",
)  # fmt: skip
COMPILER = Subject(
    "compiler-flags", "torch.compiler", "compiler/__init__.py", "_is_compiling_flag",
    "_compiler_flags_tls", "torch.compiler.is_compiling",
    # The export writers come after torch.compiler: one written through an alias cannot be followed.
    "redirect('torch._export.utils', '_export/utils.py', edit=lambda s: s + "
    "'\\n\\ndef _aliased():\\n    import torch.compiler as c\\n    c._is_compiling_flag = True\\n')",
    "is not torch.compiler",
)  # fmt: skip
SUBJECTS = [subject for subject, has in ((FX, HAS_H1), (COMPILER, TORCH_VERSION.release >= (2, 3))) if has]
pytestmark = pytest.mark.parametrize("subject", SUBJECTS, ids=str)

PRELUDE = """
import importlib.machinery, importlib.util, json, pathlib, py_compile, sys, tempfile, types, warnings, inspect
TORCH_DIR = pathlib.Path(importlib.util.find_spec("torch").submodule_search_locations[0])
TMP = pathlib.Path(tempfile.mkdtemp())

def redirect(module, relpath, edit=None, sourceless=False):
    source = (TORCH_DIR / relpath).read_text()
    path = TMP / pathlib.Path(relpath).name
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
            package = [str((TORCH_DIR / relpath).parent)] if relpath.endswith("__init__.py") else None
            return importlib.util.spec_from_file_location(
                fullname, str(path), loader=loader, submodule_search_locations=package)
    sys.meta_path.insert(0, Finder())
    return path
"""

REPORT = """
import torch
import {module} as module
rewritten = {rewritten}
code = rewritten.__code__
{after_import}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torchfix
status = next(s for s in torchfix.status() if s.name == {fix!r})
print(json.dumps({{
    "state": status.state.value, "reason": status.reason,
    "warnings": [str(w.message) for w in caught if w.category is torchfix.TorchfixWarning],
    # Nothing of this fix (other fixes may patch the same module, and may have been applied).
    "untouched": {flag!r} in vars(module) and {holder!r} not in vars(module) and rewritten.__code__ is code,
}}))
"""


def outcome(subject: Subject, setup: str, after_import: str = "", **kwargs) -> dict:
    report = REPORT.format(after_import=after_import, **vars(subject))
    return run_ok(PRELUDE + setup + report, **kwargs).json()


def redirect(subject: Subject, **options: str) -> str:
    """PRELUDE code loading the subject's first module from a copy (``edit``/``sourceless`` as there)."""
    extra = "".join(f", {name}={value}" for name, value in options.items())
    return f"path = redirect({subject.module!r}, {subject.relpath!r}{extra})\n"


def assert_refused(subject: Subject, result: dict, *reason_words: str) -> None:
    assert result["state"] == "unsupported", result
    assert result["untouched"], result
    # One warning for this fix; other fixes may warn about their own modules (an unknown version refuses all).
    about_this_fix = [w for w in result["warnings"] if w.startswith(f"torchfix: {subject.fix} ")]
    assert len(about_this_fix) == 1 and f"{subject.fix} not applied" in about_this_fix[0], result
    for word in reason_words:
        assert word in result["reason"], result


def test_source_that_differs_in_shape(subject):
    flag = subject.flag
    edit = f"lambda s: s + '\\n\\ndef _reset():\\n    global {flag}\\n    del {flag}\\n'"
    result = outcome(subject, redirect(subject, edit=edit))
    assert_refused(subject, result, f"del {flag}")


def test_source_file_changed_after_import(subject):
    result = outcome(
        subject, redirect(subject), after_import="path.write_text('# one more line\\n' + path.read_text())"
    )
    assert_refused(subject, result, "source and module differ")


def test_source_file_missing(subject):
    result = outcome(subject, redirect(subject, sourceless="True"))
    assert_refused(subject, result, "no Python source")


def test_one_failing_patch_reverts_the_whole_fix(subject):
    # A later patch of the fix fails after the first one was applied: the first must be undone too.
    result = outcome(subject, subject.break_later_patch + "\n")
    assert_refused(subject, result, subject.later_reason)


@pytest.mark.parametrize("version", ["2.99.0", "not-a-version"])
def test_unknown_torch_version(subject, version):
    result = outcome(subject, "", after_import=f"torch.__version__ = {version!r}")
    assert_refused(subject, result, "outside the releases")


def test_strict_mode_raises(subject):
    ran = run_python(
        PRELUDE + redirect(subject, sourceless="True") + "import torch\nimport torchfix\n",
        env={"TORCHFIX_STRICT": "1"},
    )
    assert ran.returncode != 0
    assert "TorchfixError" in ran.stderr and "no Python source" in ran.stderr


@pytest.mark.parametrize(
    "value, state", [("1", "disabled"), ("all", "disabled"), ("<fix>", "disabled"), ("0", "applied")]
)
def test_disable_switch(subject, value, state):
    assert outcome(subject, "", disable=value.replace("<fix>", subject.fix))["state"] == state


def test_disable_switch_with_an_unknown_name_warns_and_keeps_the_rest(subject):
    result = run_ok(
        "import warnings, json\nwarnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    import torch, torchfix\n"
        f"print(json.dumps({{'state': next(s for s in torchfix.status() if s.name == {subject.fix!r}).state.value,"
        " 'warnings': [str(w.message) for w in caught]}))",
        disable=f"{subject.fix},no-such-fix",
    ).json()
    assert result["state"] == "disabled"
    assert any("no-such-fix" in w for w in result["warnings"]), result
