"""dynamo-region-settings: ``torch._dynamo.error_on_graph_break(...)`` and ``override_cudagraphs(...)`` act in the
thread that enters them.

Two Dynamo settings for a region of code are entered at run time, by a context manager or decorator, and kept in
a module global of ``torch._dynamo.utils`` that the compile of any thread reads when it starts tracing a frame:

* ``_error_on_graph_break`` (2.9+), set through ``_set_error_on_graph_break`` by the
  ``torch._dynamo.error_on_graph_break()`` context and by every call of a function compiled with
  ``torch.compile(..., error_on_graph_break=...)``. While one thread is inside ``error_on_graph_break(True)``,
  another thread's compile of a function with a graph break raises ``Unsupported`` instead of splitting it, and
  the reverse: one thread's ``error_on_graph_break(False)`` silently lets through the graph breaks of a thread
  inside ``error_on_graph_break(True)`` (both reproduced on torch 2.13);
* ``_cudagraph_override`` (2.14+), set through ``_set_cudagraph_override`` by the
  ``torch._dynamo.override_cudagraphs(fwd=, bwd=)`` context, and seeded into every new ``OutputGraph``'s CUDA
  graph annotation. While one thread is inside it, the graphs another thread compiles get its annotation (CUDA
  graphs forced on or off in the other thread's code; sticky, since torch does not guard on it: reproduced on
  2.14.1). Torch's own comment calls it a mirror of ``_error_on_graph_break``.

Both move to per-thread storage (``utils._region_settings_tls``) with :class:`ThreadLocalGlobals` (the second
where the file has it): their accessors are the only code that reads or writes them. A thread starts with torch's
defaults (False, None). Not covered: Dynamo tracing on a thread other than the one that entered the region
(compiled autograd on autograd's device thread) reads that thread's own value; one context object entered by
two threads at once keeps one stack of the values to restore (``prev_...``), as torch does.

(Issue 12 added this fix as ``error-on-graph-break``; it took its present name with ``override_cudagraphs``, before
any release.)
"""

from __future__ import annotations

import contextlib
import threading

from .._fix import Scenario, releases
from ..doctor.scenarios import Result, fresh
from ..patching.patches import moved_globals_fix

MODULE = "torch._dynamo.utils"


def _with_graph_break(x):
    import torch

    x = x + 1
    torch._dynamo.graph_break()
    return x * 2


def _plain(x):
    return x * 3 + 1


def region_settings_elsewhere(timeout: float = 60.0) -> Result | None:
    """While thread A is inside ``torch._dynamo.error_on_graph_break(True)`` and (torch 2.14+)
    ``override_cudagraphs(fwd=False, bwd=False)``, the main thread compiles a function with a graph break (it must
    split the graph and run) and one without (its graph must get no CUDA graph annotation). Then A compiles one with
    a graph break inside its context: that must raise. None where torch has no
    ``torch._dynamo.error_on_graph_break``."""
    import torch._dynamo  # torch 2.0 has no lazy torch._dynamo attribute

    error_on_graph_break = getattr(torch._dynamo, "error_on_graph_break", None)
    if error_on_graph_break is None:
        return None
    # override_cudagraphs acts at run time (through utils._cudagraph_override) from 2.14; 2.13's is lexical only.
    runtime_override = hasattr(torch._dynamo.utils, "_get_cudagraph_override")
    override_cudagraphs = getattr(torch._dynamo, "override_cudagraphs", None) if runtime_override else None

    def compile_and_run() -> str:
        try:
            result = torch.compile(fresh(_with_graph_break), backend="eager")(torch.ones(2))
        except Exception as exc:
            return f"raised {type(exc).__name__}: {str(exc).splitlines()[0]}"
        return "ran" if result.tolist() == [4.0, 4.0] else f"returned {result.tolist()}"

    def annotation_of_a_compile() -> str:
        seen = []

        def spy_backend(gm, example_inputs):
            seen.append(repr(gm.meta.get("cudagraph_annotation")))
            return gm.forward

        try:
            torch.compile(fresh(_plain), backend=spy_backend)(torch.ones(2))
        except Exception as exc:
            return f"no graph: the compile raised {type(exc).__name__}: {str(exc).splitlines()[0]}"
        return ", ".join(seen) or "no graph"

    inside, release, in_a = threading.Event(), threading.Event(), []

    def held_thread() -> None:
        with contextlib.ExitStack() as regions:
            regions.enter_context(error_on_graph_break(True))
            if override_cudagraphs is not None:
                regions.enter_context(override_cudagraphs(fwd=False, bwd=False))
            inside.set()
            release.wait(timeout)
            in_a.append(compile_and_run())

    thread = threading.Thread(target=held_thread, name="torchfix-selftest")
    thread.start()
    inside.wait(timeout)
    try:
        mine = compile_and_run()
        annotation = annotation_of_a_compile() if override_cudagraphs is not None else None
    finally:
        release.set()
        thread.join(timeout)
    theirs = (in_a or ["no answer"])[0]
    parts = [
        (
            mine != "ran" or not theirs.startswith("raised Unsupported"),
            f"error_on_graph_break: the main thread's compile {mine}; the compile in error_on_graph_break(True) "
            f"{theirs}",
        )
    ]
    if annotation is not None:
        parts.append(
            (
                annotation != "None",
                f"override_cudagraphs: the main thread's graph got CUDA graph annotation {annotation}",
            )
        )
    wrong = sum(hazard for hazard, _ in parts)
    if wrong == len(parts):
        summary = "every setting this torch has crossed threads"
    else:
        summary = f"{wrong} of {len(parts)} settings crossed threads" if wrong else "no setting crossed threads"
    return Result(
        "Dynamo region settings (error_on_graph_break(True), override_cudagraphs in one thread, compiles in another)",
        bool(wrong),
        f"{summary}: " + "; ".join(detail for _, detail in parts),
    )


FIX = moved_globals_fix(
    "dynamo-region-settings",
    "while one thread is inside torch._dynamo.error_on_graph_break(True), other threads' graph breaks raise "
    "Unsupported (and one thread's error_on_graph_break(False) lets another's through); while one is inside "
    "torch._dynamo.override_cudagraphs(...), other threads' graphs get its CUDA graph annotation",
    "2.9",
    MODULE,
    "_region_settings_tls",
    {"_error_on_graph_break": "error_on_graph_break", "_cudagraph_override": "cudagraph_override"},
    order=65,
    optional=frozenset({"_cudagraph_override"}),
    trigger=MODULE,
    scenarios=(
        Scenario(
            region_settings_elsewhere,
            releases("2.9"),
            needs="torch._dynamo.error_on_graph_break",
            # Where torch has override_cudagraphs (2.14+), its part must cross threads too.
            shows="every setting this torch has crossed threads",
        ),
    ),
    shared_state=(
        "`torch._dynamo.error_on_graph_break()` (and every call of a function compiled with "
        "`error_on_graph_break=`) and, from 2.14, `torch._dynamo.override_cudagraphs()` keep their setting in "
        "process globals of `torch._dynamo.utils` (`_error_on_graph_break`, `_cudagraph_override`), which every "
        "thread's compile reads"
    ),
    symptom=(
        "while one thread is inside `with torch._dynamo.error_on_graph_break(True)`, another thread's compile of "
        "a function with a graph break raises `Unsupported` instead of splitting the graph (torch 2.13: every run"
        " of the self-test); one thread's `error_on_graph_break(False)` lets graph breaks through, silently, in a"
        " thread inside `error_on_graph_break(True)`; while one thread is inside `override_cudagraphs(fwd=False, "
        "bwd=False)`, the graphs other threads compile get that annotation (CUDA graphs off, or forced on, in "
        "their code, for good: torch 2.14.1)"
    ),
    releases_note='no such settings before 2.9: "not needed"; `override_cudagraphs` acts at run time from 2.14',
    seen_in_backward=True,
    survey_rows=(
        "torch/_dynamo/utils.py: _error_on_graph_break",
        "torch/_dynamo/utils.py: _cudagraph_override",
    ),
)
