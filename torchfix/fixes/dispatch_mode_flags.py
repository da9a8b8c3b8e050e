"""dispatch-mode-flags: whether a thread is inside a ``TorchDispatchMode`` is that thread's own (H15).

``torch.utils._python_dispatch`` says whether the calling code runs inside a ``TorchDispatchMode`` from module
globals: ``_is_in_torch_dispatch_mode`` (torch 2.4+, ``is_in_torch_dispatch_mode()``),
``_is_in_non_infra_torch_dispatch_mode`` (2.5+, ``is_in_torch_dispatch_mode(include_infra_modes=False)``) and
``_is_in_any_mode_without_ignore_compile_internals`` (2.9+, ``is_in_any_mode_without_ignore_compile_internals()``).
Every mode's ``__enter__`` saves them on the mode object and sets them, its ``__exit__`` restores what it saved.
The mode stack they describe is per thread (C++), so as process globals they say True in threads that are in no
mode while any thread is in one, and two threads whose modes exit out of order leave them True for the process
(reproduced on 2.13 and 2.14.1; still so in 2.15). Who reads them: Dynamo's frame callback, which skips compiling
a frame while the non-infra flag (2.5 - 2.8) or the third flag (2.9+; from 2.11 only with
``inline_torch_dispatch_torch_compile=False``, default True there) says True, so another thread's compiled
functions run eagerly, silently, while one thread is inside such a mode, and for good once the flags are stuck;
Inductor's wrapped compiled regions (2.11+); and user code.

The three move to per-thread storage (``_python_dispatch._dispatch_mode_flags_tls``) with :class:`ThreadLocalGlobals`;
names a release lacks are optional. No other module of torch reads or writes them by name. ``__enter__`` and
``__exit__`` also hand the third to a C++ flag (``set_is_in_mode_without_ignore_compile_internals``, a C++
``thread_local`` read by the guards) and now hand it the calling thread's value.

Seen in backward: the C++ dispatch-mode stack these flags mirror is part of the ``ThreadLocalState`` that autograd
copies into its device thread (CUDA) for a thread's backward, so ops there still go through that thread's modes;
the flags follow the same way (:class:`ThreadSpaces`, torch 2.13+). Before 2.13 the device thread reads False, where
torch's global said what the last mode entered in any thread left.

Cost: six per-thread writes per mode entered and left (each takes the holder's lock and the C++ stash): a
``TorchDispatchMode`` ``__enter__`` + ``__exit__`` took 54 us instead of 16 us on the loaded 2-core CPU machine
(torch 2.13). Modes are entered per region, not per op, except a ``FakeTensor`` op outside its mode: 88 entries in the
compile and first step of a small MLP (``aot_eager``), about 3 ms of its 14 s.
"""

from __future__ import annotations

import inspect
import threading

from .._fix import Scenario, releases
from ..doctor.scenarios import Result, fresh
from ..patching.patches import moved_globals_fix

MODULE = "torch.utils._python_dispatch"
FLAGS = {
    "_is_in_torch_dispatch_mode": "in_mode",  # 2.4+
    "_is_in_non_infra_torch_dispatch_mode": "in_non_infra_mode",  # 2.5+
    "_is_in_any_mode_without_ignore_compile_internals": "in_mode_without_ignore_compile_internals",  # 2.9+
}


def _flags(dispatch) -> dict[str, bool]:
    """What this torch's readers of the flags answer in the calling thread."""
    answers = {"is_in_torch_dispatch_mode()": dispatch.is_in_torch_dispatch_mode()}
    if "include_infra_modes" in inspect.signature(dispatch.is_in_torch_dispatch_mode).parameters:  # 2.5+
        answers["is_in_torch_dispatch_mode(include_infra_modes=False)"] = dispatch.is_in_torch_dispatch_mode(
            include_infra_modes=False
        )
    reader = getattr(dispatch, "is_in_any_mode_without_ignore_compile_internals", None)
    if reader is not None:
        answers["is_in_any_mode_without_ignore_compile_internals()"] = reader()
    return answers


def _in_new_thread(dispatch) -> dict[str, bool]:
    seen = {}
    thread = threading.Thread(target=lambda: seen.update(_flags(dispatch)), name="torchfix-selftest")
    thread.start()
    thread.join()
    return seen


def _double(x):
    return x * 2


def dispatch_mode_flags_elsewhere(timeout: float = 60.0) -> Result | None:
    """Thread A enters a (non-infra) ``TorchDispatchMode`` and waits; the main thread, in no mode, reads the flags and
    compiles a function. Then the main thread enters a mode of its own, A exits, the main thread exits (out of order):
    the flags must be False in the main thread and in a new thread. None before torch 2.4 (no flags)."""
    import torch
    from torch.utils import _python_dispatch as dispatch

    if not hasattr(dispatch, "is_in_torch_dispatch_mode"):
        return None

    class PassThrough(dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    inside, exit_now, exited = threading.Event(), threading.Event(), threading.Event()

    def in_mode() -> None:
        try:
            with PassThrough():
                inside.set()
                exit_now.wait(timeout)
        finally:
            inside.set()
            exited.set()

    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    thread = threading.Thread(target=in_mode, name="torchfix-selftest", daemon=True)
    thread.start()
    try:
        inside.wait(timeout)
        during = _flags(dispatch)
        torch.compile(fresh(_double), backend=counting_backend)(torch.ones(2))
        with PassThrough():  # its exit comes after A's
            exit_now.set()
            exited.wait(timeout)
    finally:
        exit_now.set()
        thread.join(timeout)
    after, elsewhere = _flags(dispatch), _in_new_thread(dispatch)
    for name in FLAGS:  # torch's own globals, left True: put back for later scenarios
        if vars(dispatch).get(name):
            setattr(dispatch, name, False)
    if hasattr(dispatch, "set_is_in_mode_without_ignore_compile_internals"):
        dispatch.set_is_in_mode_without_ignore_compile_internals(False)
    situations = (
        ("while A was in a mode, the main thread (in no mode)", during),
        ("after both exited, the main thread", after),
        ("after both exited, a new thread", elsewhere),
    )
    wrong = [
        f"{who} read True from {', '.join(reader for reader, answer in answers.items() if answer)}"
        for who, answers in situations
        if any(answers.values())
    ]
    compiled = "compiled" if graphs else "ran eagerly (Dynamo skipped the frame)"
    detail = "; ".join(wrong) or "every thread in no mode read False"
    return Result(
        "TorchDispatchMode flags (a mode in one thread, read in another; exits out of order)",
        bool(wrong) or not graphs,
        f"{detail}; the main thread's torch.compile while A was in a mode: {compiled}",
    )


FIX = moved_globals_fix(
    "dispatch-mode-flags",
    "while one thread is inside a TorchDispatchMode, is_in_torch_dispatch_mode() is True in every thread (and "
    "Dynamo skips compiling there, up to 2.10); modes exiting out of order in two threads leave it True for good",
    "2.4",
    MODULE,
    "_dispatch_mode_flags_tls",
    FLAGS,
    order=420,
    optional=frozenset(FLAGS) - {"_is_in_torch_dispatch_mode"},
    set_often=True,  # every TorchDispatchMode's enter and exit
    scenarios=(
        Scenario(
            dispatch_mode_flags_elsewhere,
            releases("2.4"),
            needs="torch.utils._python_dispatch.is_in_torch_dispatch_mode (torch 2.4+)",
            shows="while A was in a mode, the main thread (in no mode) read True from is_in_torch_dispatch_mode()",
        ),
    ),
    shared_state="torch.utils._python_dispatch._is_in_torch_dispatch_mode, _is_in_non_infra_torch_dispatch_mode and "
    "_is_in_any_mode_without_ignore_compile_internals: set and restored by every TorchDispatchMode's __enter__ and "
    "__exit__; read by is_in_torch_dispatch_mode(), Dynamo's frame callback and Inductor's compiled regions",
    symptom="torch 2.10, 2.13, 2.14.1 and 2.15: is_in_torch_dispatch_mode() (and its siblings) True in a thread in no "
    "mode while another thread is in one, and in every thread for the process after two threads' modes exit out of "
    "order (5 of 5 runs on 2.10, 2.13 and 2.15); on 2.10 a function compiled meanwhile in another thread ran eagerly, "
    "and after the out-of-order exits no thread's torch.compile compiled anything again",
    releases_note="before 2.4: no such flag; the second and third flags from 2.5 and 2.9, moved where a release "
    "has them",
    seen_in_backward=True,
    survey_rows=(
        "torch/utils/_python_dispatch.py: _is_in_torch_dispatch_mode, _is_in_non_infra_torch_dispatch_mode, "
        "_is_in_any_mode_without_ignore_compile_internals",
    ),
)
