"""fake-impl-ctx: ``torch.library.get_ctx()`` answers for the calling thread.

A custom operator's fake (meta) implementation reaches its context, to make data-dependent sizes, through
``torch.library.get_ctx()``, which calls the getter that ``set_ctx_getter`` put into one module global,
``global_ctx_getter`` of ``torch._library.fake_impl`` (``abstract_impl`` before 2.5; torch 2.2+), for the time
of each fake implementation. Every thread reads that one getter: while one thread runs a fake implementation
(a compile or an export tracing with fake tensors), ``get_ctx()`` in another thread returns the first
thread's context, so its unbacked sizes land in the other trace's shape environment; and when the first
finishes it restores the getter it found, which may be a getter another thread set meanwhile. Still a global
in 2.15.

The global moves to a ``threading.local`` with :class:`ThreadLocalGlobals`.
"""

from __future__ import annotations

from .._fix import Fix, Scenario, minor_release, releases
from .._patch import ThreadLocalGlobals, moved_global_probe

HOLDER = "_ctx_getter_tls"
GETTER = "global_ctx_getter"


def _module(torch_version: str) -> str:
    """torch 2.5 renamed abstract_impl to fake_impl."""
    return "torch._library." + ("fake_impl" if minor_release(torch_version) >= (2, 5) else "abstract_impl")


def _probe() -> str | None:
    import torch

    module = _module(str(torch.__version__))
    return moved_global_probe(module, HOLDER, GETTER, f"{module} has no {GETTER} (before torch 2.2)")()


FIX = Fix(
    name="fake-impl-ctx",
    hazard="torch.library.get_ctx() in one thread returns the fake-implementation context of another thread",
    versions=releases("2.2"),
    probe=_probe,
    patches=lambda torch_version: [
        ThreadLocalGlobals(
            _module(torch_version),
            _module(torch_version).replace(".", "/") + ".py",
            HOLDER,
            {GETTER: "ctx_getter"},
        )
    ],
    scenarios=(
        Scenario(
            "fake_impl_ctx_elsewhere",
            releases("2.4"),
            needs="torch.library.custom_op (2.4+)",
            shows="FakeImplCtx",
            # FakeTensorMode.__enter__ segfaults there when threads run fake modes at once (2 of 2 runs of it
            # after uninstall(), on 2.10), as it does for make_fx.
            crashes=releases("2.10", "2.11"),
        ),
    ),
)
