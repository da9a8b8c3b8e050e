"""export-deserializer: ``torch.export.load`` in several threads at once.

``torch._export.serde.serialize`` keeps the deserializer at work in one module global,
``_CURRENT_DESERIALIZER``: ``GraphModuleDeserializer.deserialize`` refuses to start while it is set, sets it
for the whole of its run and clears it at the end, and fake tensors unpickled meanwhile
(``_reconstruct_fake_tensor``) take their meta from it. So two threads loading exported programs at the
same time fail: the second raises ``AssertionError: _CURRENT_DESERIALIZER is already set`` (on torch 2.13,
two threads loading a small program 20 times each: 20 of 40 loads failed), or one thread's fake tensors
would be rebuilt by the other's deserializer. A global from torch 2.3 to 2.15 (upstream
pytorch/pytorch#195099, #195100).

The global moves to a ``threading.local`` (``serialize._deserializer_tls``) with :class:`ThreadLocalGlobals`:
each thread has its own deserializer slot, so loads in different threads run side by side, and a thread
still cannot nest two deserializations (torch's check stays, per thread).
"""

from __future__ import annotations

from .._fix import Scenario, releases
from .._patch import moved_globals_fix

MODULE = "torch._export.serde.serialize"

FIX = moved_globals_fix(
    "export-deserializer",
    "torch.export.load in two threads at once raises AssertionError: _CURRENT_DESERIALIZER is already set",
    "2.3",
    MODULE,
    "_deserializer_tls",
    {"_CURRENT_DESERIALIZER": "deserializer"},
    trigger=MODULE,
    scenarios=(Scenario("export_load_elsewhere", releases("2.3"), needs="the export deserializer global (2.3+)"),),
)
