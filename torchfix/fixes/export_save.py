"""export-save: ``torch.export.save`` in several threads at once.

``torch._export.serde.serialize.serialize_torch_artifact`` pickles each part of an exported program (state
dict, constants, example inputs) with a reducer for ``FakeTensor`` that it registers for the time of the
pickling in the standard library's ``copyreg.dispatch_table``, one table for the process, and it refuses
to start while that reducer is registered. So of two threads saving at once, the second raises
``AssertionError: Refusing to stomp on existing FakeTensor reducer``, or the first removes the reducer while
the second still pickles (the soak: 180 failed saves in 10 minutes on torch 2.12 with every other fix on).
Still so in 2.15.

The reducer is process state that pickle reads, so it cannot be made per thread: the module's calls of
``serialize_torch_artifact`` go through ``_torchfix_serialize_alone`` instead, which holds one process-wide
lock around it. Saves pickle one part at a time; loads, and everything else, are not serialised.
"""

from __future__ import annotations

import ast
import importlib
import threading

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result
from ..patching.patches import SourcePatch
from ..patching.source import Edit, find_replaced, parse, replace_node

MODULE = "torch._export.serde.serialize"
SERIALIZE = "serialize_torch_artifact"
ALONE = "_torchfix_serialize_alone"

_one_at_a_time = threading.Lock()


def _serialize_alone(*args: object, **kwargs: object) -> bytes:
    """``serialize_torch_artifact``, one thread at a time (its FakeTensor reducer is process-wide)."""
    with _one_at_a_time:
        return getattr(importlib.import_module(MODULE), SERIALIZE)(*args, **kwargs)


class _SaveAlone(SourcePatch):
    def __init__(self) -> None:
        super().__init__(MODULE, "torch/_export/serde/serialize.py")

    def describe(self) -> str:
        return super().describe() + f"; adds {ALONE} (one process-wide lock around {SERIALIZE})"

    def edits(self, source: str) -> list[Edit]:
        calls = find_replaced(
            self.relpath,
            parse(source),
            f"call of {SERIALIZE}",
            lambda node: isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == SERIALIZE,
            count=None,
        )
        return [replace_node(call.func, ALONE) for call in calls]

    def helpers(self) -> dict[str, object]:
        return {ALONE: _serialize_alone}


def _probe() -> str | None:
    module = importlib.import_module(MODULE)
    serialize = getattr(module, SERIALIZE, None)
    if serialize is None or "copyreg" not in serialize.__code__.co_names:
        return f"{MODULE} registers no FakeTensor reducer while it saves (before torch 2.3)"
    return None


def export_save_elsewhere(timeout: float = 60.0) -> Result | None:
    """While thread A is inside ``torch.export.save`` (pickling its example inputs, one of which waits
    there), thread B saves another program. B must save (with the fix it waits for A's part to be pickled),
    not raise "Refusing to stomp on existing FakeTensor reducer". None where this torch does not pickle an
    exported program's example inputs (before 2.4) or cannot export."""
    import copy
    import io

    import torch

    if not hasattr(getattr(torch, "export", None), "save"):
        return None
    inside, progress, release = threading.Event(), threading.Event(), threading.Event()

    class Held:
        def __reduce__(self):
            inside.set()
            progress.set()
            release.wait(timeout)
            return (int, (0,))  # pickled as a plain 0

    program = torch.export.export(torch.nn.Linear(2, 2), (torch.ones(1, 2),))
    held = copy.copy(program)
    held._example_inputs = ((Held(),), {})
    errors: dict[str, str] = {}

    def save(name: str, exported: object) -> None:
        try:
            torch.export.save(exported, io.BytesIO())
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
        finally:
            progress.set()

    a = threading.Thread(target=save, args=("A", held), name="torchfix-selftest-a", daemon=True)
    a.start()
    progress.wait(timeout)
    if not inside.is_set():  # A saved without pickling its example inputs
        a.join(timeout)
        return None if "A" not in errors else Result("export save", True, f"the held save raised {errors['A']}")
    b = threading.Thread(target=save, args=("B", program), name="torchfix-selftest-b", daemon=True)
    b.start()
    # Without the fix B fails at once; with it, B waits for A's lock until A is released.
    b.join(2.0)
    release.set()
    a.join(timeout)
    b.join(timeout)
    detail = "; ".join(f"{name} raised {error[:200]}" for name, error in sorted(errors.items())) or "both saved"
    return Result("export save (torch.export.save in two threads at once)", bool(errors), detail)


FIX = Fix(
    name="export-save",
    order=100,
    hazard="torch.export.save in two threads at once raises AssertionError: Refusing to stomp on existing "
    "FakeTensor reducer",
    versions=releases("2.3"),
    probe=_probe,
    patches=lambda _torch_version: [_SaveAlone()],
    trigger=MODULE,
    scenarios=(
        Scenario(
            export_save_elsewhere,
            releases("2.4"),  # the scenario's held save pickles the example inputs, which save writes from 2.4
            needs="an exported program's example inputs pickled on save (2.4+)",
            shows="Refusing to stomp on existing FakeTensor reducer",
        ),
    ),
    shared_state=(
        "`torch._export.serde.serialize.serialize_torch_artifact` (every `torch.export.save`) registers a pickle "
        "reducer for `FakeTensor` in the process-wide `copyreg.dispatch_table` while it pickles, and refuses to "
        "start while one is registered"
    ),
    symptom=(
        "`torch.export.save` in two threads at once: `AssertionError: Refusing to stomp on existing FakeTensor "
        "reducer` (the soak on torch 2.12: 180 failed saves in 10 minutes); the saves now pickle one part at a "
        "time, under one lock"
    ),
    releases_note='before 2.3: "not needed"',
    survey_rows=("torch/_export/serde/serialize.py: copyreg.dispatch_table[FakeTensor]",),
)
