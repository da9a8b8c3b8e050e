"""A torch we do not know (version, source, missing file) gets one clear warning and an untouched torch;
strict mode raises. Every case runs in a fresh interpreter."""

import pytest
from conftest import HAS_H1, run_ok, run_python

pytestmark = pytest.mark.skipif(not HAS_H1, reason="the fix is not needed on torch 2.14+")

# Load one torch module from a file of our choosing (an edited copy, or bytecode only), as a
# differently built torch would; then import torch and torchfix and report what happened.
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
            return importlib.util.spec_from_file_location(fullname, str(path), loader=loader)
    sys.meta_path.insert(0, Finder())
    return path
"""

REPORT = """
import torch
import torch.fx._symbolic_trace as st
trace_code = st.Tracer.trace.__code__
{after_import}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torchfix
status = torchfix.status()[0]
print(json.dumps({{
    "state": status.state.value, "reason": status.reason,
    "warnings": [str(w.message) for w in caught if w.category is torchfix.TorchfixWarning],
    # Nothing of this fix (trace-patch-isolation patches the same module, and may have been applied).
    "untouched": not any("_is_fx_tracing_flag" in vars(cls) for cls in type(st).__mro__)
        and "_is_fx_tracing_flag" in vars(st)
        and "_is_fx_tracing_tls" not in vars(st) and st.Tracer.trace.__code__ is trace_code,
}}))
"""


def outcome(setup: str, after_import: str = "", **kwargs) -> dict:
    return run_ok(PRELUDE + setup + REPORT.format(after_import=after_import), **kwargs).json()


def assert_refused(result: dict, *reason_words: str) -> None:
    assert result["state"] == "unsupported", result
    assert result["untouched"], result
    # One warning for this fix; other fixes may warn about their own modules (an unknown version refuses all).
    about_this_fix = [w for w in result["warnings"] if w.startswith("torchfix: fx-tracing-flag ")]
    assert len(about_this_fix) == 1 and "fx-tracing-flag not applied" in about_this_fix[0], result
    for word in reason_words:
        assert word in result["reason"], result


def test_source_that_differs_in_shape():
    edit = "lambda s: s + '\\n\\ndef _reset():\\n    global _is_fx_tracing_flag\\n    del _is_fx_tracing_flag\\n'"
    result = outcome(f"redirect('torch.fx._symbolic_trace', 'fx/_symbolic_trace.py', edit={edit})")
    assert_refused(result, "del _is_fx_tracing_flag")


def test_source_file_changed_after_import():
    result = outcome(
        "path = redirect('torch.fx._symbolic_trace', 'fx/_symbolic_trace.py')",
        after_import="path.write_text('# one more line\\n' + path.read_text())",
    )
    assert_refused(result, "source and module differ")


def test_source_file_missing():
    result = outcome("redirect('torch.fx._symbolic_trace', 'fx/_symbolic_trace.py', sourceless=True)")
    assert_refused(result, "no Python source")


def test_one_failing_patch_reverts_the_whole_fix():
    # The checkpoint part fails after the FX-flag part was applied: the FX part must be undone too.
    # (Renaming the function that holds the recompute closure hides it in every release's shape.)
    edit = "lambda s: s.replace('_checkpoint_without_reentrant', '_ckpt_no_reentrant')"
    result = outcome(f"redirect('torch.utils.checkpoint', 'utils/checkpoint.py', edit={edit})")
    assert_refused(result, "checkpoint")


@pytest.mark.parametrize("version", ["2.99.0", "not-a-version"])
def test_unknown_torch_version(version):
    result = outcome("", after_import=f"torch.__version__ = {version!r}")
    assert_refused(result, "outside the releases")


def test_strict_mode_raises():
    ran = run_python(
        PRELUDE + "redirect('torch.fx._symbolic_trace', 'fx/_symbolic_trace.py', sourceless=True)\n"
        "import torch\nimport torchfix\n",
        env={"TORCHFIX_STRICT": "1"},
    )
    assert ran.returncode != 0
    assert "TorchfixError" in ran.stderr and "no Python source" in ran.stderr


@pytest.mark.parametrize(
    "value, state", [("1", "disabled"), ("all", "disabled"), ("fx-tracing-flag", "disabled"), ("0", "applied")]
)
def test_disable_switch(value, state):
    assert outcome("", disable=value)["state"] == state


def test_disable_switch_with_an_unknown_name_warns_and_keeps_the_rest():
    result = run_ok(
        "import warnings, json\nwarnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    import torch, torchfix\n"
        "print(json.dumps({'state': torchfix.status()[0].state.value,"
        " 'warnings': [str(w.message) for w in caught]}))",
        disable="fx-tracing-flag,no-such-fix",
    ).json()
    assert result["state"] == "disabled"
    assert any("no-such-fix" in w for w in result["warnings"]), result
