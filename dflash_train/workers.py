"""The threads of a training job and what holds them together.

* target workers (one per target device) turn step batches into tapped hidden states and push one
  shard per drafter replica into that replica's bounded queue (backpressure);
* drafter workers (one per replica) train their replica; at every step they meet at a barrier whose
  action averages the gradients of all replicas, so the replicas stay identical;
* ``Job`` carries the first failure of any thread to the main thread and makes every other thread
  leave (no thread is left waiting on a queue or the barrier); ``Watchdog`` turns a hang into stacks
  and a non-zero exit.

Nothing here serialises compilation: threads compile concurrently, which ``import torchfix`` makes safe.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator

import torch

from . import streams
from .batch import StepBatch
from .distributed import Collectives
from .files import OutOfSpace
from .model import Drafter

EXIT_WATCHDOG = 3


class WorkerFailed(Exception):
    """A worker thread raised; the message holds its name and traceback."""

    def __init__(self, worker: str, tb: str):
        super().__init__(f"worker thread '{worker}' failed:\n{tb.rstrip()}")
        self.worker = worker


class _Leave(Exception):
    """Raised inside a worker when the job is shutting down (another worker failed, or it is done)."""


class Job:
    def __init__(self, started: float) -> None:
        self.started = started  # time.monotonic() at the start of the whole job (first-step times)
        self.stop_requested = threading.Event()  # Ctrl-C, SIGTERM: finish the current step, checkpoint, leave
        self.stop_signal: signal.Signals | None = None  # the signal that asked
        self.shutdown = threading.Event()  # every worker must leave now
        self.failure: WorkerFailed | OutOfSpace | None = None
        self.events: queue.Queue[dict] = queue.Queue()  # step reports for the main thread
        self.last_progress = time.monotonic()
        self._failure_lock = threading.Lock()  # the first failure wins
        self._on_shutdown: list[Callable[[], None]] = []
        self.threads: list[threading.Thread] = []

    def progress(self) -> None:
        self.last_progress = time.monotonic()

    def on_shutdown(self, fn: Callable[[], None]) -> None:
        self._on_shutdown.append(fn)

    def close(self) -> None:
        self.shutdown.set()
        for fn in self._on_shutdown:
            fn()

    def fail(self, worker: str) -> None:
        self.record_failure(worker)
        self.close()

    def record_failure(self, worker: str) -> None:
        """Keep the exception being handled as the job's failure, unless another came first."""
        error = sys.exc_info()[1]
        with self._failure_lock:
            if self.failure is None:
                # A full disk is no bug of ours: its one line says all, without a traceback.
                self.failure = error if isinstance(error, OutOfSpace) else WorkerFailed(worker, traceback.format_exc())

    def start(self, name: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` in a daemon thread; an exception there fails the whole job."""

        def run() -> None:
            try:
                fn()
            except (_Leave, threading.BrokenBarrierError):
                if not self.shutdown.is_set():  # a broken barrier nobody asked for is a bug: report it
                    self.fail(name)
            except BaseException:
                self.fail(name)

        thread = threading.Thread(target=run, name=name, daemon=True)
        self.threads.append(thread)
        thread.start()

    def check(self) -> None:
        if self.shutdown.is_set():
            raise _Leave

    def put(self, q: queue.Queue, item: object) -> None:
        while True:
            try:
                return q.put(item, timeout=0.1)
            except queue.Full:
                self.check()

    def get(self, q: queue.Queue) -> object:
        while True:
            try:
                return q.get(timeout=0.1)
            except queue.Empty:
                self.check()


# --- target side --------------------------------------------------------------------------------------


class Turnstile:
    """Lets target workers enqueue in step order: they compute concurrently, but the drafters must
    receive step s before step s + 1 (and a resumed run the same order as an uninterrupted one)."""

    def __init__(self, first_step: int):
        self.next_step = first_step
        self._cond = threading.Condition()

    def wait_turn(self, step: int, job: Job) -> None:
        with self._cond:
            while self.next_step != step:
                self._cond.wait(timeout=0.1)
                job.check()

    def advance(self) -> None:
        with self._cond:
            self.next_step += 1
            self._cond.notify_all()


def target_worker(
    *,
    job: Job,
    work: Callable[[int], list[StepBatch]],
    steps: range,
    turnstile: Turnstile,
    queues: list[queue.Queue],
) -> None:
    """For each of ``steps``: ``work(step)`` (one shard per drafter replica), then the shards into the
    replicas' queues, in step order, each with the event its replica's stream waits for."""
    for step in steps:
        shards = work(step)
        for shard in shards:
            shard.ready = streams.record(shard.device)
        turnstile.wait_turn(step, job)
        for q, shard in zip(queues, shards):
            job.put(q, shard)
        turnstile.advance()
        job.progress()


# --- drafter side -------------------------------------------------------------------------------------


class GradientAverager:
    """Replaces every replica's gradients with their mean, clipped, in place and bit-identical everywhere.

    The one place data parallelism happens. The mean is summed into replica 0's gradients by multi-tensor
    (``_foreach``) ops, a few kernel launches however many parameters, because this runs in one thread while
    the others wait at the barrier; it is clipped there once (every replica would compute the same norm)
    and copied to the other replicas. Under torchrun, the rank-local mean gradients and the step's figures
    are flattened into one buffer and averaged across the ranks by one all-reduce."""

    def __init__(self, replicas: list[Drafter], collectives: Collectives, grad_clip: float):
        self.params = [list(r.parameters()) for r in replicas]
        self.collectives = collectives
        self.grad_clip = grad_clip

    @torch.no_grad()
    def __call__(self, figures: torch.Tensor) -> torch.Tensor:
        """Average the gradients; return ``figures`` (this rank's, on the device) averaged over the ranks."""
        present = [i for i, p in enumerate(self.params[0]) if p.grad is not None]
        mean, *others = [[params[i].grad for i in present] for params in self.params]
        device = mean[0].device
        for grads in others:
            torch._foreach_add_(mean, [g.to(device) for g in grads])
        torch._foreach_div_(mean, len(self.params))
        if self.collectives.active:
            flat = torch.cat([*(g.flatten() for g in mean), figures.to(mean[0])])
            self.collectives.mean_(flat)
            *parts, figures = flat.split([*(g.numel() for g in mean), figures.numel()])
            torch._foreach_copy_(mean, [part.view_as(g) for part, g in zip(parts, mean)])
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([self.params[0][i] for i in present], self.grad_clip)
        for grads in others:
            torch._foreach_copy_(grads, [m.to(g.device) for m, g in zip(mean, grads)])
        return figures


class StepFigures:
    """One step's loss and accuracy, as the barrier left them on the device, read when someone asks.

    Reading them waits for that step's figures on the GPU (an event), not for the work the threads have
    queued since: a drafter thread that read them at the barrier would wait for the whole GPU queue of every
    thread, each step."""

    def __init__(self, figures: torch.Tensor, replicas: int):
        self.replicas = replicas
        self._ready: torch.cuda.Event | None = None
        if figures.is_cuda:
            with torch.cuda.device(figures.device):
                self._host = torch.empty(figures.shape, dtype=figures.dtype, pin_memory=True)
                self._host.copy_(figures, non_blocking=True)
                self._ready = torch.cuda.Event()
                self._ready.record()
        else:
            self._host = figures

    def read(self) -> dict[str, float]:
        """``loss`` (the step's mean loss) and ``acc`` (top-1 accuracy over the supervised labels)."""
        if self._ready is not None:
            self._ready.synchronize()
        loss_sum, correct, supervised = self._host.tolist()
        return {"loss": loss_sum / self.replicas, "acc": correct / max(1.0, supervised)}


class StepSync:
    """The drafter threads' rendezvous after each backward. The last thread to arrive averages the
    gradients (across ranks too) and takes the step's stop decision, so every replica of every rank
    leaves after the same step."""

    def __init__(self, replicas: list[Drafter], job: Job, collectives: Collectives, grad_clip: float):
        self.job = job
        self.size = len(replicas)
        self.collectives = collectives
        self.average = GradientAverager(replicas, collectives, grad_clip)
        self._figures: list[torch.Tensor] = [None] * self.size  # type: ignore[list-item]
        self._backward_done: list[torch.cuda.Event | None] = [None] * self.size  # each replica's, on its stream
        self._averaged: dict[torch.device, torch.cuda.Event | None] = {}  # the barrier action's, per device
        self.figures: StepFigures | None = None  # the last step's
        self.stop = False
        self.barrier = threading.Barrier(self.size, action=self._at_barrier)
        job.on_shutdown(self.barrier.abort)

    def _at_barrier(self) -> None:
        # Each replica's loss is already scaled so that the mean over replicas is the step loss. The
        # counts are averaged over ranks too, which leaves their ratio (the accuracy) as it is.
        try:
            devices = {f.device for f in self._figures}
            for event, figures in zip(self._backward_done, self._figures):
                streams.wait(event, figures.device)
            device = self._figures[0].device
            summed = torch.stack([f.to(device) for f in self._figures]).sum(0)
            self.figures = StepFigures(self.average(summed), self.size)
            self._averaged = {d: streams.record(d) for d in devices}
            self.stop = self.collectives.any_(self.job.stop_requested.is_set())  # Ctrl-C on any rank stops all
        except BaseException:
            # A failed collective (another rank died): recorded before the other threads see a broken
            # barrier and report that instead. Not job.fail(): closing aborts this barrier, whose lock its
            # action runs under (the rank hung there until its launcher killed it). The barrier breaks
            # itself when its action raises, and this thread fails the job as it leaves.
            self.job.record_failure(threading.current_thread().name)
            raise

    def wait(self, index: int, loss: torch.Tensor, correct: torch.Tensor, supervised: int) -> None:
        # Kept on the device (``new_full`` fills there: ``new_tensor`` would copy from the host and wait for the
        # GPU): [loss, correct predictions, supervised labels] of this replica.
        count = loss.new_full((), supervised, dtype=torch.float32)
        self._figures[index] = torch.stack([loss.detach().float(), correct.float(), count])
        self._backward_done[index] = streams.record(loss.device)
        self.barrier.wait()
        streams.wait(self._averaged[loss.device], loss.device)  # the averaged gradients, before the optimizer


def drafter_worker(
    *,
    job: Job,
    train_step: Callable[[StepBatch], None],
    inbox: queue.Queue,
    sync: StepSync,
    steps: range,
    after_step: Callable[[int, bool], None] | None = None,
) -> None:
    """``train_step`` on each batch of ``inbox``, for ``steps``, and ``after_step(done, last)`` after each
    (replica 0: reports, checkpoints) with the number of steps done and whether the run ends there. Each
    replica reports when its first step is done (with compilation, the time a user waits for training to
    start). Every replica leaves after the same step: the last, or the one the barrier's stop decision
    (Ctrl-C on any rank) ends."""
    for step in steps:
        batch: StepBatch = job.get(inbox)  # type: ignore[assignment]
        assert batch.step == step, f"{threading.current_thread().name} expected step {step}, got {batch.step}"
        streams.wait(batch.ready, batch.device, batch.tensors().values())  # the target's stream made them
        train_step(batch)
        job.progress()
        if step == steps[0]:
            seconds = round(time.monotonic() - job.started, 3)
            job.events.put({"type": "first_step", "thread": threading.current_thread().name, "seconds": seconds})
        last = sync.stop or step == steps[-1]
        if after_step is not None:
            after_step(step + 1, last)
        if last:
            return


# --- Ctrl-C and SIGTERM -------------------------------------------------------------------------------

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C; what schedulers (Slurm, Kubernetes) send first


class Interrupted(KeyboardInterrupt):
    """A second stop signal: quit at once, with the exit status of ``signum`` (128 + its number)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals(job: Job) -> Iterator[None]:
    """While training: the first SIGINT (Ctrl-C) or SIGTERM asks every replica to stop after the current step
    (replica 0 then saves a checkpoint), a second one quits at once (``Interrupted``).

    A handler that sets an event, rather than Python's KeyboardInterrupt: that is raised between any two
    bytecodes of the main thread, in the middle of a report or inside a queue's locked section. A signal the
    process inherited ignored (SIGINT of a job started with ``&`` from a script) stays ignored, as Python does."""
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers can be set in the main thread only
        return

    def on_signal(signum: int, frame: object) -> None:
        if job.stop_requested.is_set():
            raise Interrupted(signum)
        job.stop_signal = signal.Signals(signum)
        job.stop_requested.set()

    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}
    for signum in previous:
        signal.signal(signum, on_signal)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


# --- watchdog -----------------------------------------------------------------------------------------


class Watchdog:
    """Prints every thread's stack and exits the process (code 3) when the job shows no progress for
    ``timeout`` seconds. Without torchfix, this is how the H5 compile deadlock shows itself."""

    def __init__(self, job: Job, timeout: float):
        self.job = job
        self.timeout = timeout
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        if self.timeout > 0:
            self.job.progress()
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(timeout=min(1.0, self.timeout / 4)):
            idle = time.monotonic() - self.job.last_progress
            if idle > self.timeout:
                sys.stderr.write(dump_threads(f"dflash-train: watchdog: no progress for {idle:.0f} s"))
                sys.stderr.flush()
                os._exit(EXIT_WATCHDOG)


def dump_threads(headline: str) -> str:
    frames = sys._current_frames()
    lines = [f"{headline}; stacks of all {len(frames)} threads follow.\n"]
    for thread in threading.enumerate():
        frame = frames.get(thread.ident)
        if frame is not None and thread is not threading.current_thread():
            lines.append(f"\n--- thread {thread.name!r} (id {thread.ident}) ---\n")
            lines.extend(traceback.format_stack(frame))
    lines.append(
        "\nA drafter thread stuck in compilation (convert_frame / compile_fx / autograd) is the H5 deadlock"
        " that `import torchfix` prevents; check that it is not disabled (--no-torchfix, TORCHFIX_DISABLE).\n"
    )
    return "".join(lines)
