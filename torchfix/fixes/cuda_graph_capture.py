"""cuda-graph-capture: ``torch.cuda.graph`` captures on a side stream of the capturing thread, one capture at a time.

``torch.cuda.graph(g)`` without ``stream=`` (what ``torch.cuda.make_graphed_callables`` and most hand-written
captures use) captures on ``torch.cuda.graph.default_capture_stream``, one side stream that the class makes at its
first use and keeps for the process, on whichever device was current then. Two threads capturing at once capture
on that one stream: a capture is a property of the stream, so the second thread's kernels land in the first
thread's graph, and its own ``capture_begin`` fails on a stream that is capturing already. A thread on another
device gets a stream of the first device. And a capture's ``__enter__`` synchronises the device and empties the
caching allocator's cache, which CUDA refuses while another thread's ``"global"``-mode capture is under way (and
which invalidates that capture). Every release, 2.0 - 2.15.

The default stream becomes one per thread and device, and captures through ``torch.cuda.graph`` take one process-wide
lock from the start of ``__enter__`` (before its synchronize) to the end of ``__exit__``: CUDA graph trees
(``mode="reduce-overhead"``) record through it too, so one lock orders every capture. A capture whose
``__enter__`` raised never reaches ``__exit__``: the lock goes back when its ``graph`` object is collected.
Not covered, because it is not torch's state but CUDA's: another thread's plain CUDA work (an allocation, a
synchronize) during a ``"global"``-mode capture still fails or invalidates it; threads that capture while others
run should pass ``capture_error_mode="thread_local"``, as the graph trees do.
"""

from __future__ import annotations

import ast
import importlib
import threading
import weakref

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result
from ..patching.patches import SourcePatch, per_thread_class
from ..patching.source import Edit, ShapeError, definitions, find_replaced, replace_node, segment

MODULE = "torch.cuda.graphs"
SHARED = "self.__class__.default_capture_stream"
STREAM = "_torchfix_capture_stream"
CAPTURES = "_torchfix_captures"


# A capture runs in its thread, never in a backward: the device thread needs no stream of another thread's.
_streams = per_thread_class("_ThreadStreams", {}, {"by_device": dict}, seen_in_backward=False)()


def _capture_stream() -> object:
    """The calling thread's side stream for captures on the current device, made at its first use."""
    import torch

    device = torch.cuda.current_device()
    if device not in _streams.by_device:
        _streams.by_device[device] = torch.cuda.Stream()
    return _streams.by_device[device]


class Captures:
    """One ``torch.cuda.graph`` capture at a time in the process. A capture takes it before ``__enter__``'s
    synchronize and gives it back when ``__exit__`` has ended the capture and left its stream. A plain lock, not
    an RLock: a ``graph`` object whose ``__enter__`` raised gives it back when collected, in whatever thread that
    happens. A capture inside another in the same thread (which CUDA refuses) does not wait for itself."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread whose capture holds the lock
        self._release: weakref.finalize | None = None

    def enter(self, capture: object) -> None:
        """``__enter__``'s ``torch.cuda.synchronize()``, once this thread's capture holds the lock."""
        import torch

        if self._owner != threading.get_ident():
            self._lock.acquire()
            self._owner = threading.get_ident()
            self._release = weakref.finalize(capture, self._give_back)
        torch.cuda.synchronize()

    def end(self, capture: object) -> None:
        """``__exit__``'s ``capture_end()``; where it raises, ``__exit__`` may not go on to :meth:`exit`."""
        try:
            capture.cuda_graph.capture_end()
        except BaseException:
            self._give_back_for(capture)
            raise

    def exit(self, capture: object, *exc_info: object) -> None:
        """``__exit__``'s ``stream_ctx.__exit__``, then the lock goes back."""
        try:
            capture.stream_ctx.__exit__(*exc_info)
        finally:
            self._give_back_for(capture)

    def _give_back_for(self, capture: object) -> None:
        release = self._release
        if release is not None and release.peek() is not None and release.peek()[0] is capture:
            release()  # a finalize runs once: a second call, or the collection later, does nothing

    def _give_back(self) -> None:
        self._owner = self._release = None
        self._lock.release()


class _PerThreadCaptures(SourcePatch):
    def __init__(self) -> None:
        super().__init__(MODULE, "torch/cuda/graphs.py")

    def describe(self) -> str:
        return super().describe() + f"; adds {STREAM} (a side stream per thread and device) and {CAPTURES}"

    def edits(self, source: str) -> list[Edit]:
        methods = definitions(source)
        init, enter, exit_ = (methods.get(f"graph.{name}") for name in ("__init__", "__enter__", "__exit__"))
        if init is None or enter is None or exit_ is None:
            raise ShapeError(f"{self.relpath}: no graph.__init__, __enter__ and __exit__")
        edits = []
        for node in ast.walk(init):
            if isinstance(node, ast.Assign) and [segment(source, t) for t in node.targets] == [SHARED]:
                edits.append(replace_node(node, "pass"))  # the lazy class attribute: no longer made
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and segment(source, node) == SHARED:
                edits.append(replace_node(node, f"{STREAM}()"))
        if len(edits) != 3:  # the store, the test before it, the read
            raise ShapeError(f"{self.relpath}: graph.__init__ does not use {SHARED} as torch 2.0 - 2.15 do")
        for method, call, replacement in (
            (enter, "torch.cuda.synchronize()", f"{CAPTURES}.enter(self)"),
            (exit_, "self.cuda_graph.capture_end()", f"{CAPTURES}.end(self)"),
            (exit_, "self.stream_ctx.__exit__(", f"{CAPTURES}.exit(self, "),
        ):
            (found,) = find_replaced(
                self.relpath,
                method,
                f"{call} in graph.{method.name}",
                lambda n, call=call: isinstance(n, ast.Call) and segment(source, n).startswith(call),
            )
            text = segment(source, found)
            edits.append(replace_node(found, replacement + text[len(call) :] if call.endswith("(") else replacement))
        return edits

    def helpers(self) -> dict[str, object]:
        return {STREAM: _capture_stream, CAPTURES: Captures()}


def _probe() -> str | None:
    graph = getattr(importlib.import_module(MODULE), "graph", None)
    if graph is None or not hasattr(graph, "default_capture_stream"):
        return f"{MODULE}.graph has no default_capture_stream"
    return None


def captures_in_two_threads(timeout: float = 60.0) -> Result | None:
    """Thread A captures a CUDA graph with ``torch.cuda.graph`` (no ``stream=``) and waits inside the capture;
    meanwhile thread B captures another. B's capture must be on a stream of its own (with the fix it also waits
    for A's to end), and after both captures each graph must replay its own work. None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    x = torch.ones(4, device="cuda")
    inside, release = threading.Event(), threading.Event()
    streams: dict[str, object] = {}
    made: dict[str, object] = {}
    errors: dict[str, str] = {}
    graphs = {"A": torch.cuda.CUDAGraph(), "B": torch.cuda.CUDAGraph()}

    def capture(name: str, work, wait: bool) -> None:
        try:
            ctx = torch.cuda.graph(graphs[name])  # made in the capturing thread, as `with torch.cuda.graph(g):` is
            streams[name] = ctx.capture_stream
            with ctx:
                made[name] = work(x)
                if wait:
                    inside.set()
                    release.wait(timeout)
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        finally:
            inside.set()

    a = threading.Thread(target=capture, args=("A", lambda t: t * 2, True), name="torchfix-selftest-a")
    a.start()
    inside.wait(timeout)
    b = threading.Thread(target=capture, args=("B", lambda t: t + 1, False), name="torchfix-selftest-b")
    b.start()
    b.join(2.0)  # without the fix B captures (or fails) at once; with it, it waits for A's capture to end
    release.set()
    a.join(timeout)
    b.join(timeout)
    if not errors:
        x.fill_(3.0)
        for graph in graphs.values():
            graph.replay()
        torch.cuda.synchronize()
        for name, expected in (("A", 6.0), ("B", 4.0)):
            if not bool((made[name] == expected).all()):
                errors[name] = f"replayed to {made[name].tolist()}, not {expected}"
    detail = (
        "; ".join(f"{name}: {error}" for name, error in sorted(errors.items())) or "both graphs replay their own work"
    )
    shared = streams.get("A") is not None and streams.get("A") is streams.get("B")
    if shared:
        detail = f"one capture stream for both threads; {detail}"
    return Result("CUDA graph capture (torch.cuda.graph in two threads at once)", shared or bool(errors), detail)


FIX = Fix(
    name="cuda-graph-capture",
    order=400,
    needs_cuda=True,
    hazard="two threads capturing with torch.cuda.graph() (no stream=) at once capture on one side stream: one's "
    "kernels land in the other's graph, or a capture fails",
    versions=releases("2.0"),
    probe=_probe,
    patches=lambda _torch_version: [_PerThreadCaptures()],
    trigger=MODULE,
    scenarios=(
        Scenario(
            captures_in_two_threads,
            releases("2.0"),
            needs="a CUDA device",
            shows="one capture stream for both threads",
        ),
    ),
    shared_state=(
        "`torch.cuda.graph` without `stream=` (what `torch.cuda.make_graphed_callables` and most hand-written "
        "captures use) captures on one side stream for the process, `torch.cuda.graph.default_capture_stream`, "
        "made on whichever device was current at its first use; and nothing orders captures, whose `__enter__` "
        "synchronises the device"
    ),
    symptom=(
        "two threads capturing at once capture on one stream: on the H200 (torch 2.11) the second capture raised "
        "`operation not permitted when stream is capturing` and the first `cudaErrorStreamCaptureInvalidated`; "
        "now each thread captures on a side stream of its own (per device) and captures through "
        "`torch.cuda.graph` (CUDA graph trees' included) take one lock, one at a time"
    ),
    caveats=(
        "`cuda-graph-capture` orders captures, not CUDA: a thread's plain CUDA work (an allocation, a "
        'synchronize) while another thread\'s capture in the default `capture_error_mode="global"` is under way '
        "still fails or invalidates that capture (CUDA's rule); threads that capture while others work should "
        'capture with `capture_error_mode="thread_local"`, as CUDA graph trees do. A capture whose `__enter__` '
        "raised gives the lock back when its `torch.cuda.graph` object is collected."
    ),
    survey_rows=("torch/cuda/graphs.py: graph.default_capture_stream",),
)
