"""export-pass-flags: the switches and carried values of three export passes belong to the thread that uses them.

Three export modules keep per-call state in module globals (torch 2.5+ unless said):

* ``torch._export.passes.replace_quantized_ops_with_standard_ops_pass``: ``_INPUT_Q_DTYPE``, ``_SCALE`` and
  ``_ZERO_POINT``, fx nodes of the graph being rewritten that the pass carries from one quantized op to the next
  (TorchScript-to-export conversion, ``torch._export.converter``): two conversions at once put one graph's nodes
  into the other.
* ``torch._export.utils._DISABLE_ATEN_TO_ASSERTION_PASS`` (2.8+), set by ``_disable_aten_to_metadata_assertions()``:
  while one thread is inside, every thread's exports leave out the ``_assert_tensor_metadata`` checks before
  ``aten.to`` calls, silently.
* ``torch.export.unflatten.RUN_WITH_INTERPRETER``, cleared by ``_disable_interpreter()``: while one thread is
  inside, every thread's unflattened modules run generated code instead of the FX interpreter.

Each is read in the thread that runs its pass (the conversion, the export, the ``unflatten`` call), none in backward,
so they move to per-thread storage with :class:`ThreadLocalGlobals`, in each module where the release has them. The
fix applies when ``torch.export._trace`` is first imported (what every export, and the quantization pass itself,
imports): a program that only loads and unflattens exported programs keeps ``_disable_interpreter()`` process-wide,
and a value a thread set before that import becomes the importing thread's (as for every fix applied late).
"""

from __future__ import annotations

import importlib

from .._fix import Fix, Scenario, minor_release, releases
from ..doctor.scenarios import Result, held_elsewhere, torch_module
from ..patching.patches import ThreadLocalGlobals, moved_global_probe

QUANTIZED = "torch._export.passes.replace_quantized_ops_with_standard_ops_pass"
UTILS = "torch._export.utils"
UNFLATTEN = "torch.export.unflatten"
ASSERTS, INTERPRETER = "_DISABLE_ATEN_TO_ASSERTION_PASS", "RUN_WITH_INTERPRETER"


def _per_thread(module: str, holder: str, moved: dict[str, str]) -> ThreadLocalGlobals:
    return ThreadLocalGlobals(module, module.replace(".", "/") + ".py", holder, moved, seen_in_backward=True)


def _patches(torch_version: str) -> list[ThreadLocalGlobals]:
    patches = [
        _per_thread(
            QUANTIZED,
            "_quantized_ops_pass_tls",
            {"_INPUT_Q_DTYPE": "input_q_dtype", "_SCALE": "scale", "_ZERO_POINT": "zero_point"},
        ),
        _per_thread(UNFLATTEN, "_unflatten_tls", {INTERPRETER: "run_with_interpreter"}),
    ]
    if minor_release(torch_version) >= (2, 8):  # the aten.to assertion pass and its switch are 2.8+
        patches.append(_per_thread(UTILS, "_aten_to_assertions_tls", {ASSERTS: "disabled"}))
    return patches


def _to_double():
    """A module whose export calls ``aten.to`` (which 2.8+ exports guard with ``_assert_tensor_metadata``)."""
    import torch

    class ToDouble(torch.nn.Module):
        def forward(self, x):
            return x.to(torch.float64) + 1

    return ToDouble()


def export_pass_flags_elsewhere(timeout: float = 60.0) -> Result | None:
    """Thread A waits inside ``_disable_interpreter()`` and (2.8+) ``_disable_aten_to_metadata_assertions()``;
    meanwhile the main thread exports a module that calls ``aten.to`` and unflattens the program. Its export must
    keep the ``_assert_tensor_metadata`` check (2.8+) and its unflattened module must run with the interpreter; A
    must see its own settings. None where torch has no ``_disable_interpreter`` (before 2.5)."""
    import contextlib

    import torch

    if torch_module("torch.export._trace") is None:  # imported, it applies the fix, as every export does
        return None
    utils = importlib.import_module(UTILS)
    unflatten = importlib.import_module(UNFLATTEN)  # the module (torch.export.unflatten is also a function)

    if not hasattr(unflatten, "_disable_interpreter"):
        return None
    no_asserts = getattr(utils, "_disable_aten_to_metadata_assertions", contextlib.nullcontext)  # 2.8+
    seen: dict[str, object] = {}

    def own_view() -> None:
        seen["A's own interpreter switch"] = getattr(unflatten, INTERPRETER)

    with held_elsewhere([unflatten._disable_interpreter, no_asserts], own_view, timeout):
        program = torch.export.export(_to_double(), (torch.ones(2),))
        checks = [n for n in program.graph.nodes if n.target is torch.ops.aten._assert_tensor_metadata.default]
        seen["the main thread's export: _assert_tensor_metadata nodes"] = len(checks)
        seen["its unflattened module runs with the interpreter"] = torch.export.unflatten(program)._run_with_interpreter
    wants_checks = hasattr(utils, "_disable_aten_to_metadata_assertions")
    hazard = (
        seen["its unflattened module runs with the interpreter"] is not True
        or (wants_checks and not seen["the main thread's export: _assert_tensor_metadata nodes"])
        or seen.get("A's own interpreter switch") is not False
    )
    detail = "; ".join(f"{what}: {value}" for what, value in seen.items())
    return Result("export pass flags (_disable_interpreter / no aten.to assertions in another thread)", hazard, detail)


FIX = Fix(
    name="export-pass-flags",
    order=330,
    hazard="while one thread is inside torch.export.unflatten._disable_interpreter() or "
    "_disable_aten_to_metadata_assertions(), every thread's unflattened modules skip the interpreter and exports "
    "skip the aten.to metadata checks; two TorchScript conversions at once mix their graphs' quantization nodes",
    versions=releases("2.5"),
    probe=moved_global_probe(
        UNFLATTEN, "_unflatten_tls", INTERPRETER, f"{UNFLATTEN} has no {INTERPRETER} (before 2.5)"
    ),
    patches=_patches,
    trigger="torch.export._trace",
    scenarios=(
        Scenario(
            export_pass_flags_elsewhere,
            releases("2.5"),
            needs="torch.export.unflatten._disable_interpreter (2.5+)",
            shows="runs with the interpreter: False",
        ),
    ),
    shared_state=(
        "export passes keep per-call state in process globals: `torch.export.unflatten.RUN_WITH_INTERPRETER` "
        "(cleared by `_disable_interpreter()`), `torch._export.utils._DISABLE_ATEN_TO_ASSERTION_PASS` (set by "
        "`_disable_aten_to_metadata_assertions()`, 2.8+) and the fx nodes the TorchScript converter's "
        "quantization pass carries between ops (`_INPUT_Q_DTYPE`, `_SCALE`, `_ZERO_POINT`)"
    ),
    symptom=(
        "while one thread is inside `_disable_interpreter()` or `_disable_aten_to_metadata_assertions()`, every "
        "thread's unflattened modules run without the interpreter and its exports lose their "
        "`_assert_tensor_metadata` checks, silently (torch 2.10, 2.13, 2.15); two TorchScript conversions at once"
        " mix their graphs' nodes"
    ),
    releases_note='before 2.5: "not needed"',
    caveats=(
        "`export-pass-flags` applies when `torch.export._trace` is first imported (every export imports it): in a"
        " program that only loads and unflattens exported programs, `_disable_interpreter()` stays process-wide."
    ),
    survey_rows=(
        "torch/_export/passes/replace_quantized_ops_with_standard_ops_pass.py: _SCALE",
        "torch/_export/passes/replace_quantized_ops_with_standard_ops_pass.py: _ZERO_POINT",
        "torch/_export/passes/replace_quantized_ops_with_standard_ops_pass.py: _INPUT_Q_DTYPE",
        "torch/_export/utils.py: _DISABLE_ATEN_TO_ASSERTION_PASS",
        "torch/export/unflatten.py: RUN_WITH_INTERPRETER",
    ),
)
