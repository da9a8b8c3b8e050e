"""export-builtins: overlapping non-strict exports leave ``builtins.max`` wrapped for good.

For the whole of a non-strict ``torch.export.export`` (the default), ``_override_builtin_ops`` in
``torch._export.non_strict_utils`` (torch 2.8+) replaces ``builtins.max``, ``builtins.min`` and ``math.pow`` for
the process, with wrappers that send tensors to ``torch.maximum`` / ``torch.minimum``, and at the end restores
what it found. Of two exports that overlap, the second finds the first one's wrappers and saves those as "the
originals"; if the first ends first it restores the real builtins, and the second then restores the first
one's wrapper, which stays: every such overlap adds one more wrapper around ``max`` for good. A soak of
threads exporting (torch 2.13, every other fix on) grew the chain until, after about 9 minutes,
``max(timeout, 0)`` in ``threading.Thread.join`` raised ``RecursionError``. Still so in 2.15.

``_override_builtin_ops`` saves the real builtins instead (taken when the fix is applied), so whichever export
ends restores those and nothing is left behind. What this does not change: while any thread exports, the
wrappers serve every thread (they pass anything but tensors to the real builtin), and an export that ends
while another still traces takes the wrappers away from it, as torch does.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import math
import types

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import HeldExport, Result, export_never_held
from ..patching.patches import SourcePatch
from ..patching.source import Edit, ShapeError, definitions, replace_node, segment

MODULE = "torch._export.non_strict_utils"
REAL = "_torchfix_real_builtin"
SAVED = {"builtins.max": "max", "builtins.min": "min", "math.pow": "pow"}  # what the context saves, by its text


class _SaveTheRealOnes(SourcePatch):
    def __init__(self) -> None:
        super().__init__(MODULE, "torch/_export/non_strict_utils.py")

    def describe(self) -> str:
        return super().describe() + f"; adds {REAL} (the builtins as they were when torchfix was applied)"

    def edits(self, source: str) -> list[Edit]:
        override = definitions(source).get("_override_builtin_ops")
        saves = [
            node.value
            for node in (override.body if override is not None else [])
            if isinstance(node, ast.Assign) and segment(source, node.value) in SAVED
        ]
        if len(saves) != len(SAVED):
            raise ShapeError(f"{self.relpath}: _override_builtin_ops does not save max, min and pow (torch 2.8 - 2.15)")
        return [replace_node(value, f"{REAL}({SAVED[segment(source, value)]!r})") for value in saves]

    def helpers(self) -> dict[str, object]:
        # The builtins as they are when the fix is applied: what every export restores.
        return {REAL: {"max": builtins.max, "min": builtins.min, "pow": math.pow}.__getitem__}


def _probe() -> str | None:
    module = importlib.import_module(MODULE)
    return None if hasattr(module, "_override_builtin_ops") else f"{MODULE} patches no builtins (before torch 2.8)"


def export_builtins_after_overlap(timeout: float = 60.0) -> Result | None:
    """Thread A starts a non-strict export and waits in its forward; thread B starts one and waits too; A
    finishes, then B. Afterwards ``builtins.max`` must be the real builtin again, not one of torch's export
    wrappers (which the scenario then takes away, for the scenarios after it). None where non-strict export
    patches no builtins (before torch 2.8) or cannot run here."""
    import builtins
    import importlib

    try:
        utils = importlib.import_module("torch._export.non_strict_utils")
    except ImportError:
        return None
    if not hasattr(utils, "_override_builtin_ops"):
        return None
    scenario = "export builtins (two non-strict exports overlapping)"
    first = HeldExport(timeout).__enter__()
    if not first.inside:
        first.__exit__(None, None, None)
        return export_never_held(first, scenario)
    second = HeldExport(timeout).__enter__()
    first.__exit__(None, None, None)  # the first to start ends first
    second.__exit__(None, None, None)
    left, depth = builtins.max, 0
    while isinstance(builtins.max, functools.partial):  # torch's wrapper, left behind: unwrap it
        builtins.max = builtins.max.keywords["real_callable"]
        depth += 1
    wrong = not isinstance(left, types.BuiltinFunctionType) or depth > 0
    detail = f"builtins.max afterwards: {type(left).__name__} ({depth} wrappers deep); the exports: "
    return Result(scenario, wrong, detail + f"{first.outcome[:100]!r}, {second.outcome[:100]!r}")


FIX = Fix(
    name="export-builtins",
    order=110,
    hazard="non-strict exports that overlap leave builtins.max and min wrapped in torch's export wrappers for good, "
    "one more per overlap, until max() raises RecursionError",
    versions=releases("2.8"),
    probe=_probe,
    patches=lambda _torch_version: [_SaveTheRealOnes()],
    trigger=MODULE,
    scenarios=(
        Scenario(
            export_builtins_after_overlap,
            releases("2.8"),
            needs="non-strict export patching builtins (2.8+)",
            shows="partial (1 wrappers deep)",
            stage=3,
        ),
    ),
    shared_state=(
        "non-strict `torch.export.export` replaces `builtins.max`, `builtins.min` and `math.pow` for the process "
        "while it traces (`torch._export.non_strict_utils._override_builtin_ops`) and restores what it found"
    ),
    symptom=(
        "two exports that overlap leave one of torch's wrappers around `max` for good, one more per overlap, "
        "until `max()` anywhere raises `RecursionError` (the soak on 2.13: after about 9 minutes, in "
        "`Thread.join`)"
    ),
    releases_note='before 2.8: "not needed"',
    survey_rows=("torch/_export/non_strict_utils.py: builtins.max / builtins.min / math.pow",),
)
