"""The table of fixes (``docs/fixes.md``) and the README's list of them, written from the fixes' declarations.

Each fact about a fix is written once, in its module's ``Fix(...)``: what torch shares, what a user sees, the
releases and why, what else the fix changes. ``python -m torchfix docs`` writes them out; a test fails when the
committed files differ from what it writes.
"""

from __future__ import annotations

import re
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


def write(doc: Path, readme: Path | None, check: bool) -> list[Path]:
    """Write (or, with ``check``, compare) the doc and the README's list; returns the files that differ(ed)."""
    wanted = {doc: render_doc()}
    if readme is not None:
        wanted[readme] = with_readme_list(readme.read_text(encoding="utf-8"))
    differ = [path for path, text in wanted.items() if not path.exists() or path.read_text(encoding="utf-8") != text]
    if not check:
        for path in differ:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(wanted[path], encoding="utf-8")
    return differ
