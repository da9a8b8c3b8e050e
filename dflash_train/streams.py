"""The CUDA streams of the worker threads, and how a tensor passes from one thread's stream to another's.

With ``--cuda-streams per-thread`` every target and drafter thread issues its work on a stream of its own, so
the GPU can run the target's forward of the next step while a drafter steps: on one shared stream (``shared``,
every thread on the device's default stream) their kernels run one after the other, and any blocking copy in
one thread waits for everything the others queued.

A stream is ordered only with itself, so every hand-over is explicit:

* a tensor passed through a queue carries an event recorded after the work that made it (``record``); the
  receiver's stream waits for it (``wait``) before reading it, and ``record_stream`` tells the caching allocator
  that the receiver's stream uses its memory: without that, the block would go back to the producer's stream
  when the receiver drops it and could be overwritten while the receiver's kernels still read it;
* the drafters' gradient barrier waits for every replica's backward and each replica for the average;
* the workers' streams start after the main thread's work (initialisation, the evaluation before training) and
  the main thread waits for them all when the threads are done (``synchronize``).

On the CPU, and for CPU tensors, all of this does nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def on_own_stream(device: torch.device, per_thread: bool, fn: Callable[[], None]) -> Callable[[], None]:
    """``fn``, to be run in a worker thread on a new stream of ``device`` (with ``per_thread``, on CUDA; else on the
    default stream). The stream is made here, in the main thread, and ordered after the work queued so far."""
    stream = None
    if per_thread and device.type == "cuda":
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))

    def run() -> None:
        with torch.cuda.stream(stream):
            fn()

    return run


def record(device: torch.device) -> torch.cuda.Event | None:
    """An event at the end of what the calling thread has queued on ``device`` so far (None on the CPU)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def wait(event: torch.cuda.Event | None, device: torch.device, tensors: Iterable[torch.Tensor] = ()) -> None:
    """Make the calling thread's stream on ``device`` wait for ``event``, and mark ``tensors`` as used by it."""
    if event is None:
        return
    stream = torch.cuda.current_stream(device)
    stream.wait_event(event)
    for tensor in tensors:
        if tensor.is_cuda:
            tensor.record_stream(stream)


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait for all work on the CUDA devices among ``devices``, whichever stream it is on."""
    for device in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(device)
