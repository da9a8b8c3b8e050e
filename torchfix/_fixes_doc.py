"""The table of fixes (``docs/fixes.md``), the README's list of them and the survey's verdicts, written from the
fixes' declarations.

Each fact about a fix is written once, in its module's ``Fix(...)``: what torch shares, what a user sees, the
releases and why, what else the fix changes, which rows of the survey of torch's process state it fixes.
``python -m torchfix docs`` writes them out; a test fails when the committed files differ from what it writes.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterator
from pathlib import Path

from . import fixes
from ._fix import Fix, Releases

README_BEGIN = "<!-- the fixes: written by `python -m torchfix docs` from torchfix/fixes/*.py; edit those -->"
README_END = "<!-- end of the fixes -->"
DOC_HEADER = (
    "<!-- Written by `python -m torchfix docs` from each fix's declaration (`FIX = Fix(...)` in "
    "torchfix/fixes/<name>.py): edit those, then run it again. A test fails when this file drifts. -->"
)


def _range(releases: Releases) -> str:
    """``2.3 – 2.15``: a range as the docs print it (an en dash)."""
    return str(releases).replace(" - ", " – ")


def _releases(fix: Fix) -> str:
    return f"{_range(fix.versions)} ({fix.releases_note})" if fix.releases_note else _range(fix.versions)


def _module_path(fix: Fix) -> str:
    return fixes.MODULE_OF[fix.name].replace(".", "/") + ".py"


def render_doc(all_fixes: list[Fix] | None = None) -> str:
    """``docs/fixes.md``: a table of every fix in the order they apply, then a section per fix."""
    all_fixes = fixes.ALL if all_fixes is None else all_fixes
    lines = [
        DOC_HEADER,
        "",
        "# The fixes",
        "",
        f"{len(all_fixes)} fixes, in the order they apply. Each is one module of `torchfix/fixes/`; its edits to your "
        "torch are in `patches/<release>/<fix>.diff` (or `python -m torchfix diff`), its state in "
        "`python -m torchfix status`.",
        "",
        "| fix | torch releases patched | the hazard |",
        "|---|---|---|",
    ]
    lines += [f"| [`{f.name}`](#{f.name}) | {_range(f.versions)} | {f.hazard} |" for f in all_fixes]
    for fix in all_fixes:
        lines += ["", f"## {fix.name}", "", fix.hazard[0].upper() + fix.hazard[1:] + ".", ""]
        lines.append(f"- **Releases patched:** {_releases(fix)}")
        if fix.shared_state:
            lines.append(f"- **What torch shares:** {fix.shared_state}")
        if fix.symptom:
            lines.append(f"- **What you see without it:** {fix.symptom}")
        if fix.caveats:
            lines.append(f"- **What else it changes:** {fix.caveats}")
        if fix.scenarios:
            shown = ", ".join(f"`{s.name}` ({_range(s.hazard)})" for s in fix.scenarios)
            lines.append(
                f"- **Its self-test** (the hazard forced with events; where it shows without the fix): {shown}"
            )
        lines.append(f"- **Module:** [`{_module_path(fix)}`](../{_module_path(fix)})")
    return "\n".join(lines) + "\n"


def render_readme_list(all_fixes: list[Fix] | None = None) -> str:
    """The README's list: one line per fix, between the two markers."""
    all_fixes = fixes.ALL if all_fixes is None else all_fixes
    items = [f"- [`{f.name}`](docs/fixes.md#{f.name}) ({_range(f.versions)}): {f.hazard}" for f in all_fixes]
    return "\n".join([README_BEGIN, *items, README_END])


def with_readme_list(readme: str) -> str:
    """``readme`` with its list of fixes written anew; raises ValueError where it has no markers."""
    pattern = re.compile(re.escape(README_BEGIN) + r".*?" + re.escape(README_END), re.S)
    if not pattern.search(readme):
        raise ValueError(f"the README has no list of fixes between {README_BEGIN!r} and {README_END!r}")
    return pattern.sub(lambda _: render_readme_list(), readme, count=1)


# The survey (docs/torch-2.15-globals.md) is a reading of torch, written by hand, but for two things: the verdict of a
# row whose state a fix declares (``Fix.survey_rows``) and the table that counts the verdicts. Its tables of state
# have the columns "module | name | written by | verdict | reason" (or "evidence").
STATE_TABLE = re.compile(r"\| module \| name \| written by")
# The counts table's columns: the sections whose rows it counts (by the start of their heading).
COUNTED_SECTIONS = {"## Table": "first reading", "## Found by running": "found by running", "## The whole of": "second"}
VERDICTS = ("safe", "leaks", "fixed by", "safe: thread-local upstream", "out of reach", "unclear")  # longest match
COUNTS_HEADER = "| verdict | all rows | of the 162 `global` names | found by running | second reading |"


def survey_key(module_cell: str, name_cell: str) -> str:
    """A survey row as a fix's ``survey_rows`` names it: "module: name", its first two cells without backticks
    and kind marks (``*(attr/class)*``)."""

    def plain(cell: str) -> str:
        return " ".join(re.sub(r"\*\(.*?\)\*", "", cell).replace("`", "").split())

    return f"{plain(module_cell)}: {plain(name_cell)}"


def _state_rows(lines: list[str]) -> Iterator[tuple[int, str, list[str]]]:
    """(line index, section heading, cells split on "|") of each row of the survey's tables of state."""
    section, in_table = "", False
    for index, line in enumerate(lines):
        if line.startswith("#"):
            section = line
        if STATE_TABLE.match(line):
            in_table = True
        elif not line.startswith("|"):
            in_table = False
        elif in_table and not line.startswith("|---"):
            yield index, section, line.split("|")


def render_survey(text: str, all_fixes: list[Fix] | None = None) -> str:
    """The survey with the verdict "fixed by `<fix>`" on each row a fix's ``survey_rows`` names, and its counts
    table counted anew. Raises ValueError where a row says "fixed by" but no fix names it, where a fix names a row
    the survey lacks, or where a counted row's verdict is none of ``VERDICTS``."""
    all_fixes = fixes.ALL if all_fixes is None else all_fixes
    claims: dict[str, str] = {}
    for fix in all_fixes:
        for key in fix.survey_rows:
            if claims.setdefault(key, fix.name) != fix.name:
                raise ValueError(f"the survey row {key!r} is named by both {claims[key]} and {fix.name}")
    lines = text.split("\n")
    named, unclaimed = set(), []
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    for index, section, cells in _state_rows(lines):
        key = survey_key(cells[1], cells[2])
        if key in claims:
            named.add(key)
            cells[4] = f" fixed by `{claims[key]}` "
            lines[index] = "|".join(cells)
        elif cells[4].strip().startswith("fixed by"):
            unclaimed.append(key)
        column = next((c for start, c in COUNTED_SECTIONS.items() if section.startswith(start)), None)
        if column is None:
            continue
        verdict = max((v for v in VERDICTS if cells[4].strip().lower().startswith(v)), key=len, default=None)
        if verdict is None:
            raise ValueError(f"the survey row {key!r} has the verdict {cells[4].strip()!r}, none of {VERDICTS}")
        counts[verdict, column] += 1
        if column == "first reading" and "*(" not in cells[2]:  # a `global` name, not an attribute
            counts[verdict, "global"] += 1
    if unclaimed:
        raise ValueError(f"survey rows say 'fixed by' but no fix's survey_rows names them: {unclaimed}")
    if claims.keys() - named:
        raise ValueError(f"fixes name survey rows the survey does not have: {sorted(claims.keys() - named)}")
    return "\n".join(_with_counts(lines, counts))


def _with_counts(lines: list[str], counts: collections.Counter[tuple[str, str]]) -> list[str]:
    """``lines`` with the counts table's rows, and the sentence above it, written from ``counts``."""

    def total(column: str) -> int:
        return sum(counts[v, column] for v in VERDICTS)

    first, globals_ = total("first reading"), total("global")
    sentence = (
        f"All rows ({first + total('found by running') + total('second')}: the {globals_} `global` names + "
        f"{first - globals_} attribute/class/save-restore rows of the first reading, {total('found by running')} "
        f"rows found by running, {total('second')} rows of the second reading):"
    )
    rows = [
        f"| {'fixed by <fix>' if v == 'fixed by' else v} | {sum(counts[v, c] for c in COUNTED_SECTIONS.values())} | "
        f"{counts[v, 'global']} | {counts[v, 'found by running']} | {counts[v, 'second']} |"
        for v in VERDICTS
    ]
    header = lines.index(COUNTS_HEADER)
    start = header - 2  # the sentence, a blank line, the header, its rule, the rows
    if not lines[start].startswith("All rows ("):
        raise ValueError(f"the survey's counts table has no sentence 'All rows (...' two lines above {COUNTS_HEADER!r}")
    end = next((i for i in range(header + 2, len(lines)) if not lines[i].startswith("|")), len(lines))
    return [*lines[:start], sentence, "", COUNTS_HEADER, lines[header + 1], *rows, *lines[end:]]


def write(doc: Path, readme: Path | None, check: bool, survey: Path | None = None) -> list[Path]:
    """Write (or, with ``check``, compare) the doc, the README's list and the survey's verdicts; returns the files
    that differ(ed)."""
    wanted = {doc: render_doc()}
    if readme is not None:
        wanted[readme] = with_readme_list(readme.read_text(encoding="utf-8"))
    if survey is not None:
        wanted[survey] = render_survey(survey.read_text(encoding="utf-8"))
    differ = [path for path, text in wanted.items() if not path.exists() or path.read_text(encoding="utf-8") != text]
    if not check:
        for path in differ:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(wanted[path], encoding="utf-8")
    return differ
