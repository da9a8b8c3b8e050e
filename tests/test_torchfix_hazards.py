"""H1 and H2 forced with events, each with torchfix and with TORCHFIX_DISABLE=1.

Without torchfix the hazard must show on every torch that has it (a test that passes either way
proves nothing); with torchfix it must be gone.
"""

import pytest
from conftest import HAS_H1, HAS_H2, run_ok

SCENARIO = """
import dataclasses, json, sys
import torchfix, torch
from torchfix import _selftest
result = {call}
print(json.dumps(dataclasses.asdict(result) if result else None))
"""


def scenario(call: str, disabled: bool) -> dict:
    return run_ok(SCENARIO.format(call=call), disable="1" if disabled else None).json()


@pytest.mark.parametrize("tracer", ["symbolic_trace", "make_fx"])
def test_h1_trace_in_one_thread_breaks_compiled_call_in_another(tracer, disabled):
    result = scenario(f"_selftest.h1_nested_trace_error({tracer!r})", disabled)
    assert result["hazard"] == (disabled and HAS_H1), result


def test_h2_set_compilation_env_leaves_flag_stuck(disabled):
    result = scenario("_selftest.h2_stuck_flag()", disabled)
    if result is None:
        pytest.skip("this torch has no _set_compilation_env (H2 needs torch 2.2+)")
    assert result["hazard"] == (disabled and HAS_H2), result


def test_many_threads_calling_while_another_traces(disabled):
    result = scenario("_selftest.many_threads(rounds=12, callers=6)", disabled)
    assert result["hazard"] == (disabled and HAS_H1), result
    if disabled and HAS_H1:
        assert result["detail"].startswith("72 of 72"), result  # every call landed inside a trace
