"""Several processes: the ranks of a ``torchrun`` job, each running the threads of a single-process job.

Without torchrun, ``Collectives`` is one rank of one and every method returns at once, so the trainer
has one code path. Under torchrun, each rank:

* trains its shard of every step's batch with its own target and drafter threads;
* averages gradients across ranks inside the drafter threads' barrier action
  (``workers.GradientAverager``): the rank-local mean gradients, flattened into one buffer together
  with the step's loss and accuracy figures, take ONE all-reduce per step; the stop flag takes a
  one-number all-reduce on the host (``any_``), so that no rank waits for its GPU to decide. Exactly one thread per
  rank issues collectives at any time (the main thread outside training, the barrier action inside),
  in the same order on every rank.

Why not DistributedDataParallel: DDP wraps one module per process and hooks its backward to all-reduce
gradient buckets as they appear. Here a process holds several replicas that already meet at a thread
barrier after their backward; one all-reduce of their local mean is all that is missing there, and the
replicas of all ranks stay identical the same way the replicas of one process do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from .config import ConfigError, Ranks

# Waiting for one-off work of some ranks (the tiny target trained, rank 0 evaluating) can take far
# longer than a step; a crashed rank still ends the job at once (torchrun stops the others).
ONE_OFF_WORK_TIMEOUT = timedelta(days=1)


class Collectives:
    """The process group of a torchrun job (gloo for CPU drafters, NCCL for CUDA ones unless the ranks
    share devices), or nothing."""

    def __init__(self, ranks: Ranks, device: torch.device, timeout_s: float, gloo_only: bool = False):
        self.ranks = ranks
        self.device = device  # where collective buffers live: the rank's first drafter device
        # Under torchrun the process group starts even for one rank, so that path is the one that runs.
        self.active = ranks.launched
        if not self.active:
            return
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # gloo all-reduces CUDA tensors too (through host memory): the way for ranks that share a GPU.
        backend = "nccl" if device.type == "cuda" and not gloo_only else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        # The steps' collectives fail after ``timeout_s``; waits for one-off work use this group.
        self._patient = dist.new_group(backend="gloo", timeout=ONE_OFF_WORK_TIMEOUT)
        # Host-side decisions of a step (stop or go) are taken over gloo, on CPU tensors: over NCCL, reading
        # the answer would wait for the GPU to finish all the work queued before it.
        self._host = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def mean_(self, buffer: torch.Tensor) -> None:
        """Replace ``buffer`` by its mean over the ranks."""
        if not self.active:
            return
        # NCCL works on the calling thread's current device; this may be any drafter thread.
        with torch.cuda.device(buffer.device) if buffer.is_cuda else contextlib.nullcontext():
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
        buffer.div_(self.ranks.world_size)

    def any_(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank (the same answer on every rank)."""
        if not self.active:
            return flag
        value = torch.tensor([float(flag)])
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self._host)
        return bool(value.item())

    def broadcast_(self, tensors: list[torch.Tensor]) -> None:
        """Overwrite ``tensors`` with rank 0's values (one flat broadcast)."""
        if not self.active:
            return
        with torch.no_grad():
            flat = torch.cat([t.detach().to(self.device).flatten() for t in tensors])
            dist.broadcast(flat, src=0)
            for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
                t.copy_(part.view_as(t))

    def check_same(self, value: int, what: str) -> None:
        """Raise ConfigError on every rank unless all ranks have the same ``value``."""
        if not self.active:
            return
        extremes = torch.tensor([value, -value], device=self.device)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        high, low = int(extremes[0]), -int(extremes[1])
        if high != low:
            # Every rank stops here together: take the group down now, not in the interpreter's teardown,
            # where rank 0 (which serves the group's store) once aborted ("terminate called ...").
            self.close()
            raise ConfigError(f"every rank needs the same number of {what}: here {value}, on the ranks {low} to {high}")

    def wait_for_others(self) -> None:
        """A barrier without the step timeout, for ranks that wait while others do one-off work."""
        if self.active:
            dist.barrier(group=self._patient)

    @contextlib.contextmanager
    def local_main_first(self) -> Iterator[None]:
        """Run the block in local rank 0 of each host first, then in the others: the first fills the
        per-host cache (tiny target, regenerated data) that the others then read."""
        if self.ranks.local_rank != 0:
            self.wait_for_others()
        yield
        if self.ranks.local_rank == 0:
            self.wait_for_others()

    def gather(self, obj: object) -> list[object]:
        """Every rank's ``obj``, in rank order (a small Python object)."""
        if not self.active:
            return [obj]
        objects: list[object] = [None] * self.ranks.world_size
        dist.all_gather_object(objects, obj, group=self._patient)
        return objects

    def close(self) -> None:
        if self.active:
            self.active = False
            dist.destroy_process_group()
