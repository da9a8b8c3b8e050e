"""The doctor's self-test (``python -m torchfix``): every scenario the fixes declare, run in this process.

The scenarios' parts are in :mod:`torchfix.doctor.scenarios`, which the fixes import; this module imports the fixes
and the lifecycle, and nothing imports it but the command line.
"""

from __future__ import annotations

from .. import fixes
from .._fix import State
from .._install import status
from .scenarios import Result


def run_all(timeout: float = 60.0) -> list[Result]:
    """Every scenario the fixes declare (``Fix.scenarios``) that this torch has, in the fixes' order, stage by
    stage: without the fixes, some leave the process broken (a stuck flag, ``nn.Module`` left patched) and
    overlapping exports leave torch's pre-dispatch mode stack dirty, so those run last. A scenario that raises
    because an earlier one broke the process is reported as a failure rather than stopping the report."""
    applied = {entry.name for entry in status() if entry.state is State.APPLIED}
    declared = [
        scenario
        for fix in fixes.ALL
        for scenario in fix.scenarios
        if not scenario.needs_fix or fix.name in applied  # without its fix, such a scenario can crash torch
    ]
    results = []
    for scenario in sorted(declared, key=lambda s: s.stage):  # stable: the fixes' order within a stage
        try:
            result = scenario.function(*scenario.args, timeout=timeout)
        except Exception as exc:
            result = Result(scenario.name, True, f"raised {exc!r}")
        if result is not None:
            results.append(result)
    return results
