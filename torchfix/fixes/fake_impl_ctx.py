"""fake-impl-ctx: ``torch.library.get_ctx()`` answers for the calling thread.

A custom operator's fake (meta) implementation reaches its context, to make data-dependent sizes, through
``torch.library.get_ctx()``, which calls the getter that ``set_ctx_getter`` put into one module global,
``global_ctx_getter`` of ``torch._library.fake_impl`` (``abstract_impl`` before 2.5; torch 2.2+), for the time
of each fake implementation. Every thread reads that one getter: while one thread runs a fake implementation
(a compile or an export tracing with fake tensors), ``get_ctx()`` in another thread returns the first
thread's context, so its unbacked sizes land in the other trace's shape environment; and when the first
finishes it restores the getter it found, which may be a getter another thread set meanwhile. Still a global
in 2.15.

The global moves to per-thread storage with :class:`ThreadLocalGlobals`.
"""

from __future__ import annotations

import importlib.util
import threading

from .._fix import Fix, Scenario, minor_release, releases
from ..doctor.scenarios import Result
from ..patching.patches import ThreadLocalGlobals, moved_global_probe

HOLDER = "_ctx_getter_tls"
GETTER = "global_ctx_getter"
MODULES = ("torch._library.fake_impl", "torch._library.abstract_impl")  # torch 2.5 renamed abstract_impl


def _module(torch_version: str) -> str:
    return MODULES[0] if minor_release(torch_version) >= (2, 5) else MODULES[1]


def _probe() -> str | None:
    # By the module this torch has, not by its version (which may be any string).
    try:
        module = MODULES[0] if importlib.util.find_spec(MODULES[0]) else MODULES[1]
    except ModuleNotFoundError:
        return "this torch has no torch._library (before torch 2.2)"
    return moved_global_probe(module, HOLDER, GETTER, f"{module} has no {GETTER}")()


_HELD_FAKE_OP: list[object] = []  # the scenario's custom operator: registered once per process


def fake_impl_ctx_elsewhere(timeout: float = 60.0) -> Result | None:
    """While thread A runs a custom operator's fake implementation (under a FakeTensorMode; it waits there),
    the main thread, which runs none, calls ``torch.library.get_ctx()``: it must get no context (None), not
    A's. None where torch has no ``torch.library.custom_op`` (before 2.4)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not hasattr(torch.library, "custom_op") or not hasattr(torch.library, "get_ctx"):
        return None
    inside, release = threading.Event(), threading.Event()
    if not _HELD_FAKE_OP:
        # The schema is given: this file's annotations are strings (from __future__), which custom_op cannot read.
        @torch.library.custom_op("torchfix_selftest::held_fake", mutates_args=(), schema="(Tensor x) -> Tensor")
        def held_fake(x):
            return x.clone()

        _HELD_FAKE_OP.append(held_fake)
    op = _HELD_FAKE_OP[0]

    def fake(x):
        inside.set()
        release.wait(timeout)
        return torch.empty_like(x)

    op.register_fake(fake)  # replaces the previous run's (its events are spent)
    errors: list[str] = []

    def run_fake() -> None:
        try:
            with FakeTensorMode() as mode:
                op(mode.from_tensor(torch.ones(2)))
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=run_fake, name="torchfix-selftest", daemon=True)
    thread.start()
    if not inside.wait(timeout):
        thread.join(timeout)
        return Result("fake impl ctx", True, f"the fake implementation never ran: {errors}")
    seen = torch.library.get_ctx()
    release.set()
    thread.join(timeout)
    detail = f"the main thread's get_ctx(): {type(seen).__name__}" + (f"; A raised {errors[0]}" if errors else "")
    return Result(
        "fake impl ctx (get_ctx() while another thread runs a fake implementation)",
        seen is not None or bool(errors),
        detail,
    )


FIX = Fix(
    name="fake-impl-ctx",
    order=160,
    hazard="torch.library.get_ctx() in one thread returns the fake-implementation context of another thread",
    versions=releases("2.2"),
    probe=_probe,
    patches=lambda torch_version: [
        ThreadLocalGlobals(
            _module(torch_version),
            _module(torch_version).replace(".", "/") + ".py",
            HOLDER,
            {GETTER: "ctx_getter"},
            seen_in_backward=True,
        )
    ],
    scenarios=(
        Scenario(
            fake_impl_ctx_elsewhere,
            releases("2.4"),
            needs="torch.library.custom_op (2.4+)",
            shows="FakeImplCtx",
            # FakeTensorMode.__enter__ segfaults there when threads run fake modes at once (2 of 2 runs of it
            # after uninstall(), on 2.10), as it does for make_fx.
            crashes=releases("2.10", "2.11"),
        ),
    ),
    shared_state=(
        "`torch._library.fake_impl.global_ctx_getter` (`abstract_impl` before 2.5), what "
        "`torch.library.get_ctx()` returns inside a custom operator's fake implementation, is a process global "
        "set and restored around each fake implementation"
    ),
    symptom=(
        "while one thread runs a fake implementation (a compile or an export), `get_ctx()` in another returns the"
        " first thread's context, so its data-dependent sizes land in the other trace"
    ),
    releases_note='before 2.2: "not needed"',
    survey_rows=(
        "torch/_library/fake_impl.py: global_ctx_getter",
        "torch/_custom_op/impl.py, _library/fake_class_registry.py: global_ctx_getter",
    ),
)
