"""Outputs for people: metrics.jsonl (one JSON object per line) and a PNG plot of loss and tau."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from .config import ConfigError


class MetricsLog:
    """Appends records to ``metrics.jsonl``. Every record has a ``type`` (train, eval, first_step, dynamo
    or summary) and ``elapsed_s``, the seconds since this run started. ``path`` None (the ranks other
    than 0 of a torchrun job) writes nothing.

    With ``tensorboard`` (a folder), the numbers of every record that has a ``step`` (train, eval) are also
    TensorBoard scalars, tagged ``type/name``, at that step: torch's own ``SummaryWriter``, which needs the
    ``tensorboard`` package."""

    def __init__(self, path: Path | None, *, append: bool, started: float, tensorboard: Path | None = None):
        self.path = path
        self.started = started
        self._board = _summary_writer(tensorboard) if path is not None and tensorboard is not None else None
        self._file = path.open("a" if append else "w") if path is not None else None

    def write(self, record_type: str, **fields: Any) -> None:
        if self._file is None:
            return
        elapsed = round(time.monotonic() - self.started, 3)
        self._file.write(json.dumps({"type": record_type, **fields, "elapsed_s": elapsed}) + "\n")
        self._file.flush()
        if self._board is not None and "step" in fields:
            for name, value in fields.items():
                if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._board.add_scalar(f"{record_type}/{name}", value, fields["step"])
            self._board.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._board is not None:
            self._board.close()
            self._board = None


def _summary_writer(folder: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch's module imports the tensorboard package
        raise ConfigError(
            f"--tensorboard {folder}: TensorBoard events need the tensorboard package (pip install tensorboard, "
            "or the trainer's `tensorboard` extra)"
        ) from e
    return SummaryWriter(log_dir=str(folder))


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_metrics(metrics: Path, png: Path) -> None:
    """Loss and accuracy per step (left), tau at each evaluation (middle), the acceptance histogram of the
    first and the last evaluation (right)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; safe outside the main thread
    import matplotlib.pyplot as plt

    records = read_metrics(metrics)
    train = [r for r in records if r["type"] == "train"]
    evals = [r for r in records if r["type"] == "eval"]
    fig, (ax_loss, ax_tau, ax_hist) = plt.subplots(1, 3, figsize=(16, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="loss", color="tab:blue")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("decayed CE loss")
    ax_loss.set_yscale("log")  # the first steps start far above the rest
    ax_loss.set_title("drafter training")
    ax_acc = ax_loss.twinx()
    ax_acc.plot([r["step"] for r in train], [r["acc"] for r in train], color="tab:orange", alpha=0.6)
    ax_acc.set_ylabel("draft token accuracy", color="tab:orange")
    ax_tau.plot([r["step"] for r in evals], [r["tau"] for r in evals], "o-", color="tab:green")
    for r in evals:
        ax_tau.annotate(f"{r['tau']:.2f}", (r["step"], r["tau"]), textcoords="offset points", xytext=(0, 6))
    ax_tau.set_xlabel("step")
    ax_tau.set_ylabel("acceptance length tau")
    ax_tau.set_title("tau (greedy block verification)")
    ax_tau.set_ylim(bottom=0)
    shown = [r for r in (evals[:1] + evals[1:][-1:]) if "histogram" in r]
    for offset, r in zip((-0.2, 0.2), shown):
        bars = range(1, len(r["histogram"]))
        ax_hist.bar([k + offset for k in bars], r["histogram"][1:], width=0.4, label=f"step {r['step']}")
    ax_hist.set_xlabel("tokens produced per target forward")
    ax_hist.set_ylabel("share of verification steps")
    ax_hist.set_title("acceptance histogram")
    if shown:
        ax_hist.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
