"""dynamo-trace-state: what a Dynamo trace keeps in module globals belongs to the thread that traces.

A Dynamo trace keeps some of its state in module globals, written and read during the trace in the tracing thread:

* ``torch._dynamo.convert_frame.initial_global_state``: the grad mode, autocast and other global state a frame
  compile of ``torch.compile`` saw when it started (saved, set and, from 2.11, restored in
  ``ConvertFrameAssert.__call__``); ``OutputGraph`` (2.9+; ``guards.py`` before) reads it by attribute into the
  guards of any Dynamo trace in progress;
* ``torch._dynamo.trace_rules._force_inline_flag`` (2.11+): saved, set and restored by ``_force_inline()`` while
  Dynamo inlines a helper (``utils._make_inlined``: the pytree calls of ``nonstrict_trace`` and leaf functions);
  ``check_verbose`` reads it for every skip-or-inline decision: while it is True, Dynamo's skip rules are off;
* ``torch._dynamo.variables.builder``'s memos of the parsed ``torch.compiler.config`` source lists,
  ``_DYNAMIC_SOURCES`` and ``_UNBACKED_SOURCES`` (2.8+), ``_DYNAMIC_VALUES`` (2.13+) and ``_STATIC_SOURCES``
  (2.15), each a value and a ``*_CONFIG_HASH`` of the config it was parsed from, written in two statements.

Up to torch 2.8 every Dynamo trace holds ``convert_frame.compile_lock`` (``torch.compile``, ``torch._dynamo.export``
and so strict ``torch.export`` alike), so no two traces use this state at once: "not needed" there. Torch 2.9 added
``convert_frame.fullgraph_capture``, which traces without that lock: ``torch.compile(...).aot_compile`` (2.9+) and
strict ``torch.export.export`` (through it by default from 2.10) run while another thread's ``torch.compile``
traces. Then (reproduced on 2.13 and 2.14.1): an ``aot_compile`` made while another thread compiles under
``torch.no_grad()`` takes that compile's global state into its guards (``AssertionError: Guard failed on the same
frame it was created ... GLOBAL_STATE changed: grad_mode``, 2.10+; a mis-guarded artifact on 2.9); a trace inside
``_force_inline()`` turns the skip rules off for every thread's traces, and two that overlap, exiting out of order,
leave the flag True for the process; and from 2.12, where the config is per thread, a thread can take the other's
memo (its dynamic, unbacked or static sources) when a switch between threads falls between the two writes.

Each module's globals move to per-thread storage (``_trace_state_tls`` in each module) with
:class:`ThreadLocalGlobals`; names a release lacks are optional, and a module with none of them (``trace_rules``
before 2.11) is left alone. Every reader runs in the tracing thread, so a thread starts with torch's defaults
(None, False), as a single-threaded ``aot_compile`` does. Runtime code reads none of it.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import threading

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result, fresh
from ..patching.patches import ThreadLocalGlobals, moved_global_probe

HOLDER = "_trace_state_tls"
CONVERT_FRAME, TRACE_RULES, BUILDER = (
    "torch._dynamo.convert_frame",
    "torch._dynamo.trace_rules",
    "torch._dynamo.variables.builder",
)
# The builder's memo pairs: (value, config hash) for each config source list; the torch release that added it.
MEMOS = {"_DYNAMIC_SOURCES": "2.8", "_UNBACKED_SOURCES": "2.8", "_DYNAMIC_VALUES": "2.13", "_STATIC_SOURCES": "2.15"}


def _builder_names() -> tuple[dict[str, str], frozenset[str]]:
    moved, optional = {}, set()
    for name, first in MEMOS.items():
        for global_name in (name, f"{name}_CONFIG_HASH"):
            moved[global_name] = global_name.lstrip("_").lower()
            if first != "2.8":  # every release this fix patches (2.9+) has the 2.8 ones
                optional.add(global_name)
    return moved, frozenset(optional)


def _patches(_torch_version: str) -> list[ThreadLocalGlobals]:
    builder_moved, builder_optional = _builder_names()
    return [
        ThreadLocalGlobals(
            CONVERT_FRAME,
            "torch/_dynamo/convert_frame.py",
            HOLDER,
            {"initial_global_state": "initial_global_state"},
            seen_in_backward=True,
        ),
        ThreadLocalGlobals(
            TRACE_RULES,
            "torch/_dynamo/trace_rules.py",
            HOLDER,
            {"_force_inline_flag": "force_inline"},
            optional=frozenset({"_force_inline_flag"}),
            seen_in_backward=True,
        ),
        ThreadLocalGlobals(
            BUILDER,
            "torch/_dynamo/variables/builder.py",
            HOLDER,
            builder_moved,
            optional=builder_optional,
            seen_in_backward=True,
        ),
    ]


def _probe() -> str | None:
    convert_frame = importlib.import_module(CONVERT_FRAME)
    if not hasattr(convert_frame, "fullgraph_capture"):
        return (
            "every Dynamo trace holds compile_lock in this torch (no fullgraph_capture, the unlocked trace of "
            "aot_compile and strict export: before torch 2.9), so no two traces share this state at once"
        )
    return moved_global_probe(
        CONVERT_FRAME, HOLDER, "initial_global_state", f"{CONVERT_FRAME} has no initial_global_state"
    )()


def _times_two_plus_one(x):
    return x * 2 + 1


def _cos_plus_one(x):
    return x.cos() + 1


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"


def _global_state_part(timeout: float) -> tuple[bool, str]:
    """Thread A's ``torch.compile`` under ``torch.no_grad()`` waits in its backend; meanwhile the main thread
    (grad mode on) reads ``convert_frame.initial_global_state`` (what its trace would read) and makes an
    ``aot_compile`` (a trace without compile_lock). It must keep its own state and make a working artifact."""
    import torch
    from torch._dynamo import convert_frame

    inside, release, errors = threading.Event(), threading.Event(), []

    def held_backend(gm, example_inputs):
        inside.set()
        release.wait(timeout)
        return gm.forward

    def compile_without_grad() -> None:
        try:
            with torch.no_grad():
                torch.compile(fresh(_times_two_plus_one), backend=held_backend)(torch.ones(2))
        except Exception as exc:
            errors.append(_first_line(exc))

    before = convert_frame.initial_global_state  # the main thread's own (None, or its last compile's up to 2.10)
    thread = threading.Thread(target=compile_without_grad, name="torchfix-selftest", daemon=True)
    thread.start()
    try:
        if not inside.wait(timeout):
            return True, f"initial_global_state: the held compile never reached its backend {errors}"
        seen = convert_frame.initial_global_state
        try:
            compiled = torch.compile(fresh(_cos_plus_one), fullgraph=True, backend="eager")
            compiled.aot_compile(((torch.ones(2),), {}))
            aot = "ran"
        except Exception as exc:
            aot = f"raised {_first_line(exc)}"
    finally:
        release.set()
        thread.join(timeout)
    leaked = seen is not before
    owner = "the held compile's (no_grad)" if leaked else "its own"
    return leaked or "GLOBAL_STATE" in aot, f"initial_global_state: the main thread read {owner}, its aot_compile {aot}"


def _force_inline_part(timeout: float) -> tuple[bool, str] | None:
    """Thread A enters ``trace_rules._force_inline()`` (as a trace inlining a helper does) and waits: the main
    thread's skip rules must stay on. Then the main thread enters its own, A exits, the main thread exits: the
    flag must not stay set. None before 2.11 (no such flag)."""
    import torch  # noqa: F401  (torch._dynamo below)
    from torch._dynamo import trace_rules

    force_inline = getattr(trace_rules, "_force_inline", None)
    if force_inline is None:
        return None

    def inlined_by_force() -> bool:  # what check_verbose says of any function inside _force_inline()
        return "_force_inline" in trace_rules.check_verbose(trace_rules.check_verbose).reason

    inside, main_inside, exited = threading.Event(), threading.Event(), threading.Event()

    def held() -> None:
        with force_inline():
            inside.set()
            main_inside.wait(timeout)
        exited.set()

    thread = threading.Thread(target=held, name="torchfix-selftest", daemon=True)
    thread.start()
    inside.wait(timeout)
    during = inlined_by_force()
    with force_inline():  # the exits out of order: A's restores False, then the main thread's its saved True
        main_inside.set()
        exited.wait(timeout)
    thread.join(timeout)
    stuck = inlined_by_force()
    if vars(trace_rules).get("_force_inline_flag"):  # torch's own global, left True: put back for later scenarios
        trace_rules._force_inline_flag = False
    said = "inside the other thread's _force_inline() context" if during else "not inside another's _force_inline()"
    after = ", and left inside it for the process after both exited" if stuck else ""
    return during or stuck, f"_force_inline_flag: the main thread's skip rules said {said}{after}"


def _memo_part(timeout: float) -> tuple[bool, str] | None:
    """Thread A, with its own ``torch.compiler.config.dynamic_sources``, parses it in
    ``builder.get_dynamic_sources`` and stops between the memo's two writes (a switch between threads can fall
    there); the main thread, whose config names no source, asks for its own. None where the config is one for
    the process (before 2.12: both threads rightly see one list)."""
    import torch
    from torch._dynamo.variables import builder

    get = getattr(builder, "get_dynamic_sources", None)
    if get is None or not hasattr(torch.compiler.config, "dynamic_sources"):
        return None
    lines, first = inspect.getsourcelines(get)
    second_write = [first + i for i, line in enumerate(lines) if "_DYNAMIC_SOURCES_CONFIG_HASH = " in line]
    if len(second_write) != 1:
        return True, "dynamic-sources memo: get_dynamic_sources is not the shape this scenario knows"
    paused, release, mine = threading.Event(), threading.Event(), []

    def pause_at_second_write(frame, event, arg):
        if event == "call" and frame.f_code is get.__code__:

            def in_get(frame, event, arg):
                if event == "line" and frame.f_lineno == second_write[0]:
                    paused.set()
                    release.wait(timeout)
                return in_get

            return in_get
        return None

    def held() -> None:
        with torch.compiler.config.patch(dynamic_sources="L['held']"):
            previous = sys.gettrace()
            sys.settrace(pause_at_second_write)
            try:
                get()
            finally:
                sys.settrace(previous)
                paused.set()

    get()  # the main thread's list, parsed and kept
    thread = threading.Thread(target=held, name="torchfix-selftest", daemon=True)
    thread.start()
    paused.wait(timeout)
    try:
        if torch.compiler.config.dynamic_sources == "L['held']":
            return None  # one config for the process
        mine.append(get())
    finally:
        release.set()
        thread.join(timeout)
    leaked = bool(mine[0])
    return leaked, f"dynamic-sources memo: the main thread's get_dynamic_sources() returned {mine[0]!r}" + (
        " (the other thread's)" if leaked else ""
    )


def dynamo_trace_state_elsewhere(timeout: float = 60.0) -> Result | None:
    """Each piece of Dynamo trace state this torch has, held by another thread as a trace holds it, must not reach
    the main thread's traces: the global state of a ``torch.compile`` in progress, a ``_force_inline()`` context,
    a half-written memo of the config's source lists. None where torch has no ``aot_compile`` (before 2.9: every
    trace holds compile_lock)."""
    import torch
    from torch._dynamo import convert_frame

    if not hasattr(convert_frame, "fullgraph_capture") or not hasattr(torch.compile(_cos_plus_one), "aot_compile"):
        return None
    parts = [_global_state_part(timeout), _force_inline_part(timeout), _memo_part(timeout)]
    parts = [part for part in parts if part is not None]
    leaked = sum(hazard for hazard, _ in parts)
    if leaked == len(parts):
        summary = f"another thread's trace state reached the main thread in every part this torch has ({leaked})"
    elif leaked:
        summary = f"another thread's trace state reached the main thread in {leaked} of {len(parts)} parts"
    else:
        summary = f"the main thread kept its own trace state in all {len(parts)} parts"
    return Result(
        "Dynamo trace state (a compile, a _force_inline() context, a config memo held in another thread)",
        bool(leaked),
        f"{summary}: " + "; ".join(detail for _, detail in parts),
    )


FIX = Fix(
    name="dynamo-trace-state",
    order=300,
    hazard="a Dynamo trace without compile_lock (aot_compile, strict export) reads another thread's trace state: "
    "its grad mode (Guard failed on the same frame it was created), its _force_inline() (skip rules off, or "
    "stuck off for the process), its parsed config source lists",
    versions=releases("2.9"),
    probe=_probe,
    patches=_patches,
    trigger="torch._dynamo",
    scenarios=(
        Scenario(
            dynamo_trace_state_elsewhere,
            releases("2.12"),  # 2.9 - 2.11: aot_compile is off by default, and its eager graphs do not serialize
            needs="torch.compile(...).aot_compile, on by default (torch 2.12+)",
            shows="in every part this torch has",
        ),
    ),
    shared_state=(
        "a Dynamo trace keeps state in module globals: `torch._dynamo.convert_frame.initial_global_state` (the "
        "grad mode and other global state the compile started with, which the guards take), "
        "`trace_rules._force_inline_flag` (skip rules off while Dynamo inlines a helper; 2.11+) and "
        "`variables/builder.py`'s memos of the parsed `torch.compiler.config` source lists; from 2.9, "
        "`aot_compile` and strict `torch.export` trace without `compile_lock`, beside other threads' compiles"
    ),
    symptom=(
        "an `aot_compile` made while another thread compiles under `torch.no_grad()` raises `AssertionError: "
        "Guard failed on the same frame it was created ... GLOBAL_STATE changed: grad_mode` (torch 2.13, 2.14.1);"
        " while one trace is inside `_force_inline()`, other threads' traces ignore the skip rules, and two that "
        "overlap can leave them off for the process; a thread can take another's dynamic, unbacked or static "
        "source lists (2.12+, where the config is per thread)"
    ),
    releases_note=(
        'before 2.9 every Dynamo trace holds `compile_lock`, so no two use this state at once: "not needed"'
    ),
    survey_rows=(
        "torch/_dynamo/convert_frame.py: initial_global_state",
        "torch/_dynamo/trace_rules.py: _force_inline_flag",
        "torch/_dynamo/variables/builder.py: _DYNAMIC_SOURCES",
        "torch/_dynamo/variables/builder.py: _DYNAMIC_SOURCES_CONFIG_HASH",
        "torch/_dynamo/variables/builder.py: _UNBACKED_SOURCES",
        "torch/_dynamo/variables/builder.py: _UNBACKED_SOURCES_CONFIG_HASH",
        "torch/_dynamo/variables/builder.py: _STATIC_SOURCES",
        "torch/_dynamo/variables/builder.py: _STATIC_SOURCES_CONFIG_HASH",
        "torch/_dynamo/variables/builder.py: _DYNAMIC_VALUES",
        "torch/_dynamo/variables/builder.py: _DYNAMIC_VALUES_CONFIG_HASH",
    ),
)
