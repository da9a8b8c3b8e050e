"""Outputs for people: metrics.jsonl (one JSON object per line) and a PNG plot of loss and tau."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .config import ConfigError
from .files import replace_text


class Progress:
    """What a long loop shows people: a tqdm bar when stderr is a terminal and ``bar`` is on; otherwise (output
    to a file, --no-progress) a plain line every ``every`` steps and at the last one, so that a log holds lines,
    not a bar's carriage returns. ``quiet`` (the ranks but 0 of a torchrun job) shows nothing."""

    def __init__(
        self, desc: str, total: int, *, initial: int = 0, bar: bool, every: int, unit: str = "step", quiet: bool = False
    ):
        self.desc, self.total, self.every, self.unit, self.quiet = desc, total, max(1, every), unit, quiet
        show_bar = bar and not quiet and sys.stderr.isatty()
        self._bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True) if show_bar else None

    def update(self, n: int, figures: dict[str, str]) -> None:
        """``n`` of ``total`` done; ``figures`` (name: formatted value) describe the last one."""
        if self._bar is not None:
            self._bar.update(n - self._bar.n)
            self._bar.set_postfix(figures)
        elif not self.quiet and (n % self.every == 0 or n == self.total):
            line = ", ".join(f"{name} {value}" for name, value in figures.items())
            print(f"{self.desc} {self.unit} {n}/{self.total}" + (f": {line}" if line else ""), flush=True)

    def note(self, text: str) -> None:
        """A word on what is going on (the bar's postfix until the next update, or a line)."""
        if self._bar is not None:
            self._bar.set_postfix_str(text)
        elif not self.quiet:
            print(f"{self.desc}: {text}", flush=True)

    def write(self, text: str) -> None:
        """A line for people, above the bar."""
        if self._bar is not None:
            self._bar.write(text)
        elif not self.quiet:
            print(text, flush=True)

    def restart_clock(self) -> None:
        """Time the rate and ETA from now on: the steps so far (the first, compiling) say nothing of the rest."""
        if self._bar is not None:
            done = self._bar.n
            self._bar.reset(total=self.total)  # the clock and the smoothed rate start again
            self._bar.initial = self._bar.n = self._bar.last_print_n = done
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MetricsLog:
    """Appends records to ``metrics.jsonl``. Every record has a ``type`` (train, eval, first_step, dynamo,
    memory, summary, resume) and ``elapsed_s``, the seconds since this run started. ``path`` None (the ranks
    other than 0 of a torchrun job) writes nothing.

    A run resumed at step ``resumed_at`` continues the file as an uninterrupted run would have written it (see
    ``continue_metrics``), after a ``resume`` record; any other run starts it anew.

    With ``tensorboard`` (a folder), the numbers of every record that has a ``step`` (train, eval) are also
    TensorBoard scalars, tagged ``type/name``, at that step: torch's own ``SummaryWriter``, which needs the
    ``tensorboard`` package."""

    def __init__(
        self, path: Path | None, *, resumed_at: int | None, started: float, tensorboard: Path | None = None
    ) -> None:
        self.path = path
        self.started = started
        self._board = _summary_writer(tensorboard) if path is not None and tensorboard is not None else None
        self._file = None
        if path is None:
            return
        if resumed_at is None:
            self._file = path.open("w")
            return
        dropped = continue_metrics(path, resumed_at) if path.is_file() else 0
        self._file = path.open("a")
        self.write("resume", step=resumed_at, dropped_records=dropped)

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


def continue_metrics(path: Path, resumed_at: int) -> int:
    """Make ``path`` fit for a run resumed at step ``resumed_at`` to append to: drop the records of later steps
    (written by the run that was stopped after its last checkpoint: the resumed run does those steps again)
    and any torn line (a kill in the middle of a write), with a warning. Returns how many records it dropped."""
    records = read_metrics(path)
    kept = [r for r in records if r.get("step", 0) <= resumed_at]
    if len(kept) < len(records):
        print(
            f"dflash-train: warning: {path}: dropped {len(records) - len(kept)} records of the steps after "
            f"{resumed_at} (the checkpoint's), which this run does again",
            file=sys.stderr,
        )
    replace_text(path, "".join(json.dumps(r) + "\n" for r in kept))
    return len(records) - len(kept)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file; a line that is not one (torn by a kill) is skipped, with a warning."""
    records, torn = [], []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            record = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            torn.append(number)
            continue
        if isinstance(record, dict) and "type" in record:
            records.append(record)
        elif record is not None:
            torn.append(number)
    if torn:
        lines = ", ".join(map(str, torn))
        print(f"dflash-train: warning: {path}: skipped line {lines}, not a record (a write cut short)", file=sys.stderr)
    return records


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
