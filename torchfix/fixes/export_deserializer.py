"""export-deserializer: ``torch.export.load`` in several threads at once.

``torch._export.serde.serialize`` keeps the deserializer at work in one module global,
``_CURRENT_DESERIALIZER``: ``GraphModuleDeserializer.deserialize`` refuses to start while it is set, sets it
for the whole of its run and clears it at the end, and fake tensors unpickled meanwhile
(``_reconstruct_fake_tensor``) take their meta from it. So two threads loading exported programs at the
same time fail: the second raises ``AssertionError: _CURRENT_DESERIALIZER is already set`` (on torch 2.13,
two threads loading a small program 20 times each: 20 of 40 loads failed), or one thread's fake tensors
would be rebuilt by the other's deserializer. A global from torch 2.3 to 2.15 (upstream
pytorch/pytorch#195099, #195100).

The global moves to per-thread storage (``serialize._deserializer_tls``) with :class:`ThreadLocalGlobals`:
each thread has its own deserializer slot, so loads in different threads run side by side, and a thread
still cannot nest two deserializations (torch's check stays, per thread).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

from .._fix import Scenario, SoakCheck, releases
from ..doctor.scenarios import Result
from ..patching.patches import moved_globals_fix

MODULE = "torch._export.serde.serialize"


def export_load_elsewhere(timeout: float = 60.0) -> Result | None:
    """While thread A is inside ``torch.export.load`` (held at its first torch function once torch's
    deserializer is at work, by a ``TorchFunctionMode`` of that thread), the main thread loads the same
    program: both must load. None where torch has no deserializer global to hold a load at (before 2.3)."""
    import io

    import torch
    from torch.overrides import TorchFunctionMode

    export = getattr(torch, "export", None)
    if export is None or not hasattr(export, "load"):
        return None
    from torch._export.serde import serialize

    if not {"_CURRENT_DESERIALIZER", "_deserializer_tls"} & vars(serialize).keys():
        return None  # before 2.3: no deserializer global, and no point to hold a load at
    saved = io.BytesIO()
    export.save(export.export(torch.nn.Linear(2, 2), (torch.ones(1, 2),)), saved)

    inside, release = threading.Event(), threading.Event()

    class HoldInsideLoad(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            # The deserializer torch has at work, as the calling thread sees it (None before 2.3).
            if not inside.is_set() and getattr(serialize, "_CURRENT_DESERIALIZER", None) is not None:
                inside.set()
                release.wait(timeout)
            return func(*args, **(kwargs or {}))

    def load() -> str:
        try:
            export.load(io.BytesIO(saved.getvalue()))
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "loaded"

    def held_load() -> str:
        with HoldInsideLoad():
            return load()

    held: list[str] = []
    thread = threading.Thread(target=lambda: held.append(held_load()), name="torchfix-selftest")
    thread.start()
    inside.wait(timeout)
    mine = load()
    release.set()
    thread.join(timeout)
    detail = f"the main thread's load: {mine}; the held thread's: {(held or ['no answer'])[0]}"
    return Result(
        "export (torch.export.load in two threads at once)", (held or [""])[0] != "loaded" or mine != "loaded", detail
    )


def soak_leak_probe() -> Callable[[bool], bool]:
    """Whether the calling thread sees ``_CURRENT_DESERIALIZER`` set (by another thread's torch.export.load)."""
    return lambda at_end: getattr(sys.modules.get(MODULE), "_CURRENT_DESERIALIZER", None) is not None


FIX = moved_globals_fix(
    "export-deserializer",
    "torch.export.load in two threads at once raises AssertionError: _CURRENT_DESERIALIZER is already set",
    "2.3",
    MODULE,
    "_deserializer_tls",
    {"_CURRENT_DESERIALIZER": "deserializer"},
    order=90,
    trigger=MODULE,
    scenarios=(Scenario(export_load_elsewhere, releases("2.3"), needs="the export deserializer global (2.3+)"),),
    shared_state=(
        "`torch._export.serde.serialize._CURRENT_DESERIALIZER`, the deserializer a `torch.export.load` has at "
        "work, is a process global (upstream #195099, #195100)"
    ),
    symptom=(
        "`torch.export.load` in two threads at once: `AssertionError: _CURRENT_DESERIALIZER is already set` "
        "(torch 2.13: 20 of 40 loads of two threads)"
    ),
    releases_note='before 2.3: "not needed"',
    seen_in_backward=True,
    soak=SoakCheck(errors=("_CURRENT_DESERIALIZER",), leak_probe=soak_leak_probe),
    survey_rows=("torch/_export/serde/serialize.py: _CURRENT_DESERIALIZER",),
)
