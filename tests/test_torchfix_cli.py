"""python -m torchfix: the doctor, the diffs (and patches/ drift), stress, run, pth."""

import ast
import json
import re
from pathlib import Path

import pytest
from conftest import (
    FIXES,
    HAS_H1,
    SURVEY,
    SURVEYED,
    TORCH_CRASHES_ON_CONCURRENT_MAKE_FX,
    TORCH_VERSION,
    run_ok,
    run_python,
    torchfix_cli,
)

PATCHES = Path(__file__).resolve().parent.parent / "patches" / TORCH_VERSION.base_version


def test_doctor_reports_every_fix_and_passes_the_self_test():
    # Fresh, as a user runs it: torchfix imported before torch (the fixes apply through its import hooks), and the
    # interpreter's own exit after the self-test's threads. Every fix's scenarios, one after another: a minute on an
    # idle 2-core machine.
    ran = torchfix_cli(timeout=600, forked=None)
    assert "fx-tracing-flag" in ran.stdout and "FAIL" not in ran.stdout, ran.stdout + ran.stderr
    assert ran.returncode == 0 and ran.stdout.rstrip().endswith("OK"), ran.stdout + ran.stderr


# Each release's hazards are shown one scenario at a time (test_torchfix_hazards); here, only that the doctor
# reports them.
@pytest.mark.release_independent
@pytest.mark.skipif(not HAS_H1, reason="torch 2.14+ has no FX-flag hazard to show")
def test_doctor_without_torchfix_shows_the_hazards():
    ran = torchfix_cli(disable="1")
    assert ran.returncode == 1
    assert ran.stdout.count("FAIL") >= 2 and "disabled" in ran.stdout


def test_diff_prints_the_patches_of_the_installed_torch():
    ran = torchfix_cli("diff")
    assert ran.returncode == 0, ran.stderr
    if HAS_H1:
        assert "+++ b/torch/fx/_symbolic_trace.py" in ran.stdout
    else:
        assert "fx-tracing-flag: not needed" in ran.stdout


def test_patches_dir_has_not_drifted():
    if not PATCHES.is_dir():
        pytest.skip(f"patches/ has no directory for torch {TORCH_VERSION.base_version}")
    ran = run_ok(
        """
import importlib, json, torch, torchfix
from torchfix import fixes
from torchfix.__main__ import _installed_reader
for fix in fixes.ALL:  # the fixes that wait for a part of torch (Dynamo, Inductor) apply when it is imported
    try:
        importlib.import_module(fix.trigger)
    except ImportError:
        pass  # this torch has no such module: the fix is "not needed"
applied = {s.name for s in torchfix.status() if s.state.value == "applied"}
diffs = {fix.name: fix.diff(torch.__version__, _installed_reader) for fix in fixes.ALL if fix.name in applied}
print(json.dumps(diffs))
""",
        forked="triggers",
    ).json()
    committed = {p.stem: p.read_text() for p in PATCHES.glob("*.diff")}
    assert ran == committed, "patches/ drifted from what torchfix applies: regenerate it (see docs/usage.md)"


def test_patches_command_regenerates_a_release_from_its_wheel(tmp_path):
    """``python -m torchfix patches DIR``: each release folder rebuilt from that release's wheel, read as a zip
    (here one made of the installed torch's sources, so that nothing is downloaded), stale diffs removed."""
    import importlib.util
    import zipfile

    if not PATCHES.is_dir():
        pytest.skip(f"patches/ has no directory for torch {TORCH_VERSION.base_version}")
    site = Path(importlib.util.find_spec("torch").submodule_search_locations[0]).parent
    wheels, release = tmp_path / "wheels", tmp_path / "patches" / TORCH_VERSION.base_version
    wheels.mkdir()
    release.mkdir(parents=True)
    (release / "gone.diff").write_text("a fix that no longer applies")
    with zipfile.ZipFile(wheels / f"torch-{TORCH_VERSION.base_version}-cp3-none-any.whl", "w") as wheel:
        for source in (site / "torch").rglob("*.py"):
            wheel.write(source, source.relative_to(site).as_posix())
    ran = torchfix_cli("patches", str(tmp_path / "patches"), "--wheels", str(wheels))
    assert ran.returncode == 0, ran.stdout + ran.stderr
    made = {p.name: p.read_text() for p in release.glob("*.diff")}
    assert made == {p.name: p.read_text() for p in PATCHES.glob("*.diff")}


ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.release_independent
def test_the_table_of_fixes_the_readme_list_and_the_survey_verdicts_have_not_drifted():
    paths = ("--doc", str(ROOT / "docs" / "fixes.md"), "--readme", str(ROOT / "README.md"), "--survey", str(SURVEY))
    ran = torchfix_cli("docs", "--check", *paths)
    assert ran.returncode == 0, ran.stdout + ran.stderr + "\nregenerate them: python -m torchfix docs"
    listed = re.findall(r"^- \[`([a-z0-9-]+)`\]", (ROOT / "README.md").read_text(), re.M)
    assert listed == [fix["name"] for fix in FIXES], "the README lists every fix, in the order they apply"


SURVEY_TEXT = """All rows (0: ...):

| verdict | all rows | of the 162 `global` names | found by running | second reading |
|---|---|---|---|---|
| safe | 0 | 0 | 0 | 0 |

## Table (grouped by module)

| module | name | written by (function, how) | verdict | reason |
|---|---|---|---|---|
| `torch/a.py` | `flag` *(attr/class)* | f | leaks | read by every call |
| `torch/a.py` | `other` | g | safe | under compile_lock |
"""


@pytest.mark.release_independent
def test_a_fix_that_names_a_survey_row_writes_its_verdict_and_the_counts():
    code = f"""
import dataclasses, json
from torchfix import _fixes_doc, fixes
fix, found = fixes.ALL[0], {{}}
for rows in [("torch/a.py: flag",), (), ("torch/a.py: gone",)]:
    try:
        found[repr(rows)] = _fixes_doc.render_survey({SURVEY_TEXT!r}, [dataclasses.replace(fix, survey_rows=rows)])
    except ValueError as exc:
        found[repr(rows)] = str(exc)
try:
    _fixes_doc.render_survey(open({str(SURVEY)!r}).read(), [])
except ValueError as exc:
    found["no fix"] = str(exc)
print(json.dumps([fix.name, found]))
"""
    name, found = run_ok(code).json()
    fixed = found["('torch/a.py: flag',)"]
    assert f"| `torch/a.py` | `flag` *(attr/class)* | f | fixed by `{name}` | read by every call |" in fixed
    assert "All rows (2: the 1 `global` names + 1 attribute/class/save-restore rows" in fixed
    assert "| fixed by <fix> | 1 | 0 | 0 | 0 |" in fixed and "| leaks | 0 | 0 | 0 | 0 |" in fixed
    assert "| safe | 1 | 1 | 0 | 0 |" in fixed
    assert fixed.endswith(SURVEY_TEXT[SURVEY_TEXT.index("\n## Table") :].replace("| leaks |", f"| fixed by `{name}` |"))
    # The verdict stays "fixed by" only while a fix names the row, and a fix names only rows the survey has.
    assert "| leaks | 1 | 0 | 0 | 0 |" in found["()"]
    assert "does not have: ['torch/a.py: gone']" in found["('torch/a.py: gone',)"]
    assert "survey rows say 'fixed by' but no fix's survey_rows names them" in found["no fix"]


# The fixes the survey's prose names (its triage's "fixed since by `name`"; a fix's name has a hyphen). Its tables'
# verdicts "fixed by `name`" are written from the fixes' survey_rows (the drift test above).
FIXED_BY = set(re.findall(r"fixed (?:since\**\s+)?by `?([a-z0-9]+(?:-[a-z0-9]+)+)", SURVEY.read_text(), re.I))


@pytest.mark.release_independent
def test_every_fixed_by_of_the_survey_names_a_fix():
    assert FIXED_BY and FIXED_BY <= {fix["name"] for fix in FIXES}, FIXED_BY - {fix["name"] for fix in FIXES}


@pytest.mark.release_independent
def test_each_fix_of_the_surveyed_release_names_the_survey_rows_it_fixes():
    # A fix of the surveyed release removes a leak of process state that the survey has a row of. A hazard that
    # only costs time (a compile done twice) is no state's leak.
    of_the_release = [fix for fix in FIXES if fix["releases"][0] <= list(SURVEYED) <= fix["releases"][1]]
    missing = [fix["name"] for fix in of_the_release if not fix["survey_rows"] and not fix["cost"]]
    assert not missing, f"these fixes name no row of {SURVEY.name} (survey_rows): {missing}"


# conftest's flags that state a torch fact no fix declares, so written there by hand.
TORCH_FACTS_BY_HAND = {"HAS_H6"}


@pytest.mark.release_independent
def test_conftest_reads_the_releases_the_fixes_declare():
    # A release written into conftest by hand ((2, 6), Version("2.6")) copies a fix's versions or a scenario's
    # hazard or crashes releases, and drifts from it: conftest reads those from the declarations (_DECLARED).
    def by_hand(node: ast.AST) -> bool:
        return any(
            (
                isinstance(n, ast.Tuple)
                and n.elts
                and all(isinstance(e, ast.Constant) and type(e.value) is int for e in n.elts)
            )
            or (
                isinstance(n, ast.Call)
                and getattr(n.func, "id", "") == "Version"
                and isinstance(n.args[0], ast.Constant)
            )
            for n in ast.walk(node)
        )

    module = ast.parse((ROOT / "tests" / "conftest.py").read_text())
    assigned = [node for node in module.body if isinstance(node, ast.Assign) and by_hand(node.value)]
    names = {target.id for node in assigned for target in node.targets}
    assert names == TORCH_FACTS_BY_HAND, f"read these from the fixes' declarations: {names - TORCH_FACTS_BY_HAND}"


@pytest.mark.release_independent
def test_the_soaks_actions_and_hazards_are_the_fixes():
    ran = run_ok(
        """
import json
from torchfix.doctor import stress
print(json.dumps({"actions": [a.name for a in stress.ACTIONS], "errors": stress.ERROR_HAZARDS}))
""",
        disable="1",
        forked="torch",
    ).json()
    actions, texts = ran["actions"], [text for text, _hazard in ran["errors"]]
    assert len(actions) == len(set(actions)) and len(texts) == len(set(texts)), ran  # each names one
    assert set(actions) == {*STRESS_ACTIONS.split(","), "export", "inductor call"}  # what --actions has taken
    hazards = {hazard for _text, hazard in ran["errors"]} - {"compiled call ran eagerly"}
    assert hazards <= {fix["name"] for fix in FIXES}, hazards


def test_the_readmes_before_and_after_fails_without_torchfix_and_passes_with_it():
    readme = (ROOT / "README.md").read_text()
    example = readme.split("## Before and after", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    # Forked from torch alone: the block imports torch, then torchfix, as it would in a fresh interpreter.
    with_fix, without = run_python(example, forked="torch"), run_python(example, disable="1", forked="torch")
    assert with_fix.returncode == 0 and "ok:" in with_fix.stdout, with_fix.stdout + with_fix.stderr
    if HAS_H1:  # the hazard it forces, every run (torch 2.14 made the flag per thread upstream)
        assert without.returncode == 1, without.stdout + without.stderr
        assert "Detected that you are using FX to symbolically trace" in without.stderr


@pytest.mark.release_independent
def test_run_executes_a_script_with_torchfix_loaded(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import sys, torch\nprint(sys.argv[1:], [s.state.value for s in sys.modules['torchfix'].status()])\n"
    )
    ran = torchfix_cli("run", str(script), "--lr", "3")
    assert ran.returncode == 0, ran.stderr
    assert "['--lr', '3']" in ran.stdout and ("applied" in ran.stdout or "not needed" in ran.stdout)


@pytest.mark.release_independent
def test_pth_loads_torchfix_in_a_new_interpreter(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    torchfix_cli("pth", "install", "--site-dir", str(site))
    ran = run_ok(f"import site, sys; site.addsitedir({str(site)!r}); print('torchfix' in sys.modules)")
    assert ran.stdout.strip() == "True"
    torchfix_cli("pth", "remove", "--site-dir", str(site))
    assert not any(site.iterdir())


# The soak's actions but export (concurrent torch.export.export is not thread-safe even with torchfix: see the
# docs/usage.md) and inductor (C++ compiles are slow here).
STRESS_ACTIONS = (
    "symbolic_trace,make_fx,eager cond,compiled call,fresh compile,stance force_eager,node meta,eager module,graph code"
)


@pytest.mark.skipif(
    TORCH_CRASHES_ON_CONCURRENT_MAKE_FX, reason="torch 2.10 - 2.11 segfault when threads make_fx at once"
)
def test_stress_is_clean_with_torchfix_and_shows_the_hazards_without():
    # Each run warms up (every action once) before its 4 s: two interpreters of torch's import, first compiles and
    # window, slow on a loaded machine.
    args = ("--seconds=4", "--threads=3", "--no-inductor", f"--actions={STRESS_ACTIONS}", "--json")
    ran = torchfix_cli("stress", *args, timeout=420)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    runs = json.loads(ran.stdout)
    for label in ("on", "off"):
        assert "failed" not in runs[label] and sum(runs[label]["actions"].values()) > 50, runs[label]
        assert runs[label]["warm_up_s"] > 0, runs[label]  # the first compiles were before the window
    on, off = runs["on"], runs["off"]
    assert on["errors"] == {} and on["stuck"] == [] and on["hung"] == [], on
    assert all(leaked == 0 and samples > 0 for leaked, samples in on["leaks"].values()), on["leaks"]
    # Without torchfix, every release has some of these hazards (H1 to 2.13, H3 from 2.3, H4 in all).
    assert off["errors"] or off["stuck"] or any(leaked for leaked, _ in off["leaks"].values()), off


@pytest.mark.release_independent
def test_bad_command_line_is_one_clear_error():
    ran = torchfix_cli("diff", "--source-root", "/nonexistent")
    assert ran.returncode == 2 and "--torch-version" in ran.stderr
    ran = torchfix_cli("run")
    assert ran.returncode == 2 and "usage" in ran.stderr
    ran = torchfix_cli("stress", "--actions=make_fx,juggling")
    assert ran.returncode == 2 and "unknown action(s) juggling" in ran.stderr
    ran = torchfix_cli("stress", "--seconds=0")
    assert ran.returncode == 2 and "--seconds must be positive" in ran.stderr


@pytest.mark.release_independent
def test_status_lists_every_fix_without_the_self_test_and_help_reads_plainly():
    ran = torchfix_cli("status")
    assert ran.returncode == 0, ran.stderr
    assert [line.split()[0] for line in ran.stdout.splitlines()] == [fix["name"] for fix in FIXES]
    assert "self-test" not in ran.stdout
    helped = torchfix_cli("--help")
    assert helped.returncode == 0 and "`" not in helped.stdout and "status" in helped.stdout
