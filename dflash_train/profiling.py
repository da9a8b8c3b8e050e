"""``--profile-steps FIRST:LAST``: torch.profiler over steps FIRST+1 .. LAST of a run, every thread's work.

The main thread starts and stops the profiler when replica 0's reports of steps FIRST and LAST reach it (a
report is read once the step's work has ended on the device), while every thread goes on with its own
steps: the window holds what the whole job did meanwhile, the target threads' forwards
and every replica's step, CPU ops and (on CUDA) kernels. torch's profiler records only the thread that
started it unless told otherwise (``profile_all_threads``, torch 2.7+).

Written to ``<out-dir>/profile/``: ``trace.json`` (open in Perfetto or chrome://tracing), ``ops.txt`` (the ops
by self time) and ``ops.json`` (per op: calls, self CPU and self device time, in microseconds; what
``python -m bench cost --profile`` compares between runs with torchfix and without).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import ConfigError


def _all_threads_config() -> object:
    try:
        from torch._C._profiler import _ExperimentalConfig

        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError) as exc:  # TypeError: an older torch's config has no such field
        raise ConfigError(
            f"--profile-steps needs a torch whose profiler can record every thread (2.7+; this is {torch.__version__})"
        ) from exc


class StepProfiler:
    """Profiles the job between the reports of two steps; writes what it saw to ``out``."""

    def __init__(self, window: tuple[int, int], out: Path, cuda: bool) -> None:
        self.first, self.last = window
        self.out = out
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities, experimental_config=_all_threads_config())
        self._running = False

    def at_step(self, done: int) -> None:
        """Step ``done`` (a count) has ended: start or stop the window there."""
        if done == self.first:
            self._profile.__enter__()
            self._running = True
        elif done == self.last and self._running:
            self._profile.__exit__(None, None, None)
            self._running = False
            self._write()

    def close(self) -> None:
        """Stop a window the job left open (it failed or stopped early); nothing is written."""
        if self._running:
            self._running = False
            self._profile.__exit__(None, None, None)

    def _write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self._profile.export_chrome_trace(str(self.out / "trace.json"))
        averages = self._profile.key_averages()
        device = any(getattr(e, "self_device_time_total", 0) for e in averages)
        sort = "self_device_time_total" if device else "self_cpu_time_total"
        (self.out / "ops.txt").write_text(averages.table(sort_by=sort, row_limit=60) + "\n")
        ops = [
            {
                "op": e.key,
                "calls": e.count,
                "self_cpu_us": e.self_cpu_time_total,
                "self_device_us": getattr(e, "self_device_time_total", 0.0),
            }
            for e in averages
        ]
        steps = self.last - self.first
        (self.out / "ops.json").write_text(json.dumps({"steps": steps, "ops": ops}, indent=1) + "\n")
        print(f"profile of steps {self.first + 1} to {self.last}: {self.out}", flush=True)
