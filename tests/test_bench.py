"""The benchmarks run (tiny sizes). They measure; they assert nothing about speed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["overhead", "coldstart", "trainer"])
def test_benchmark_smoke(name, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench", name, "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"== {name}" in proc.stdout
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["torch"]
    # Every configuration ran (a failed one is reported, not raised).
    assert not [row for row in result.get("rows", []) if "error" in row], result
    if name == "overhead":
        # Counted, not timed: torchfix adds no call to a compiled call, only its fast flag reads (three
        # bytecode instructions each; torch 2.13 reads five flags per call).
        work = result["compiled_call_work"]
        assert work["calls_with_torchfix"] == work["calls_without_torchfix"], work
        assert 0 <= work["opcodes_with_torchfix"] - work["opcodes_without_torchfix"] <= 20, work
