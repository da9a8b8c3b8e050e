"""Which devices a rank's threads use, and what they share there: the device flags resolved for this rank, the
CPU cores split among the worker threads, the peak memory the job used."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from .config import ConfigError, Ranks, TrainConfig, parse_devices


def cuda_offset(cfg: TrainConfig, ranks: Ranks) -> int:
    """How far this rank shifts the CUDA indices of the device flags, which name devices as one rank
    sees them: local rank L uses cuda:(i + L * N) for cuda:i, N = the highest index named + 1 (the
    number of GPUs one rank uses, when they are cuda:0..N-1), so the ranks of a host share no GPU."""
    if cfg.ranks_share_devices:
        return 0
    names = [n for spec in (cfg.target_devices, cfg.drafter_devices) for n in parse_devices(spec, "devices")]
    indices = [int(n.partition(":")[2] or 0) for n in names if n.startswith("cuda")]
    return ranks.local_rank * (max(indices) + 1) if indices else 0


def resolve_devices(spec: str, flag: str, offset: int = 0) -> list[torch.device]:
    """The devices a device flag names, CUDA indices shifted by ``offset`` (``cuda_offset``); ConfigError for a
    CUDA device this host does not have."""
    devices = []
    for name in parse_devices(spec, flag):
        device = torch.device(name)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError(f"{flag}: {name} asked for, but CUDA is not available here")
            index = (device.index or 0) + offset
            if index >= torch.cuda.device_count():
                shifted = f" (cuda:{index} on this local rank)" if offset else ""
                raise ConfigError(f"{flag}: {name}{shifted} does not exist ({torch.cuda.device_count()} CUDA devices)")
            device = torch.device("cuda", index)
        devices.append(device)
    return devices


@contextlib.contextmanager
def cpu_thread_budget(cpu_workers: int) -> Iterator[None]:
    """Share the cores among the worker threads that compute on the CPU (of all ranks on this host).

    torch's intra-op thread count is process-wide: with its default (all cores) in each of several
    worker threads, OpenMP teams oversubscribe the cores and spin waiting for each other."""
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if cpu_workers > 1:
        torch.set_num_threads(max(1, cores // cpu_workers))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def peak_memory(devices: set[torch.device]) -> dict[str, float]:
    """This process's peak memory in GiB: allocated by torch on each CUDA device, and resident (host)."""
    peaks = {str(d): torch.cuda.max_memory_allocated(d) / 2**30 for d in sorted(devices, key=str) if d.type == "cuda"}
    try:
        import resource  # Unix only
    except ImportError:
        return peaks
    peaks["host_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return peaks
