"""The run's folder (``--out-dir``) and the other paths of a run, checked before anything slow starts.

A run's folder holds ``config.toml`` (the run's settings, readable, and a ``--config`` file for a run like it),
``metrics.jsonl``, ``plot.png`` and ``checkpoint.safetensors``. A new run never writes into a folder that holds
a run: ``--resume`` continues that run with its ``config.toml`` (flags given again change it, and are named),
``--overwrite`` deletes it first. Like the command line, this module does not import torch: its checks run in
the first second, before torch and the target load.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shlex
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

from .config import SECTIONS, ConfigError, Ranks, TrainConfig, make_config, read_config_file, tap_layer_ids
from .files import check_not_in_use

CONFIG, METRICS, PLOT, CHECKPOINT, PROFILE = (
    "config.toml",
    "metrics.jsonl",
    "plot.png",
    "checkpoint.safetensors",
    "profile",
)
# Written last into every export: the names of the files it wrote. A folder holding it and only those files is
# an earlier export, which a new one may replace; export writes into no other folder that is not empty.
EXPORT_MARKER = ".dflash_train_export.json"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def holds_run(folder: Path) -> bool:
    """Whether ``folder`` holds what a run trained: a checkpoint, or metrics of steps. A config.toml alone (a run
    that failed before it began) is not a run."""
    metrics = folder / METRICS
    return (folder / CHECKPOINT).is_file() or (metrics.is_file() and metrics.stat().st_size > 0)


def check_folder(path: str, what: str, *, create: bool) -> None:
    """``path`` is, or can become, a folder this process writes in; ``create`` makes it now. ConfigError if not."""
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{what} {path} is a file, not a folder")
    existing = next(p for p in [folder, *folder.parents] if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{what} {path}: {existing} is a file, not a folder")
    if create:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"{what} {path}: cannot create it ({e.strerror})") from e
        existing = folder
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot write in {existing} ({e.strerror})") from e


def check_paths(cfg: TrainConfig, ranks: Ranks | None = None) -> None:
    """Every path of the run, before anything slow: the target and the text exist, the drafter's depth fits the
    target, the folders written are folders and writable, and the run folder's rules (see the module)."""
    ranks = ranks or Ranks.from_env()
    out = Path(cfg.out_dir)
    if ranks.is_main:  # first: a second run there is told so, whatever its flags
        check_not_in_use(out)
    if cfg.target != "tiny":
        target_config = Path(cfg.target) / "config.json"
        if not target_config.is_file():
            raise ConfigError(f"--target {cfg.target}: not a local Hugging Face model folder (no config.json)")
        try:
            layers = json.loads(target_config.read_text())["num_hidden_layers"]
        except (ValueError, KeyError, TypeError):
            layers = None  # a config transformers reads some other way: load_target checks the taps
        if isinstance(layers, int):
            tap_layer_ids(layers, cfg.drafter_layers)
    if cfg.data != "stdlib" and not Path(cfg.data).exists():
        raise ConfigError(f"--data: {cfg.data} does not exist")
    if cfg.resume:
        if not (out / CHECKPOINT).is_file():
            missing = f"{out} does not exist" if not out.exists() else "run once without --resume"
            raise ConfigError(
                f"--resume: no checkpoint at {out / CHECKPOINT} ({missing}; under torchrun on several hosts, "
                "--out-dir must be on a filesystem they share)"
            )
        for name, started, now in changes_since_start(cfg):
            if name in TrainConfig.MODEL_FIELDS:
                raise ConfigError(
                    f"--resume: the run in {out} is incompatible with this one: it was started with {_flag(name)} "
                    f"{started!r}, and its checkpoint cannot go on with {_flag(name)} {now!r} (start a new run in "
                    "another --out-dir)"
                )
    if ranks.is_main and cfg.tensorboard:
        check_folder(cfg.tensorboard, "--tensorboard", create=False)
        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError(
                f"--tensorboard {cfg.tensorboard}: TensorBoard events need the tensorboard package (pip install "
                "tensorboard, or the trainer's `tensorboard` extra)"
            )
    if ranks.is_main and cfg.export:
        check_folder(cfg.export, "--export", create=False)
        check_export_folder(Path(cfg.export))
    if ranks.is_main and not cfg.resume and not cfg.overwrite and out.is_dir() and holds_run(out):
        raise ConfigError(
            f"--out-dir {cfg.out_dir} holds a run: continue it with --resume, delete it with --overwrite, or give "
            "another --out-dir"
        )
    check_folder(cfg.cache_dir, "--cache-dir", create=False)
    # The folders made last, so that no mistake leaves one behind.
    check_folder(cfg.out_dir, "--out-dir", create=ranks.is_main)
    check_folder(cfg.cache_dir, "--cache-dir", create=True)


def check_export_folder(out_dir: Path) -> None:
    """Raise ConfigError unless ``out_dir`` is missing, empty, or an earlier export holding only what it wrote."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ConfigError(f"export folder {out_dir} is a file: give a new or empty folder")
    present = set(os.listdir(out_dir))
    if not present:
        return
    try:
        written = set(json.loads((out_dir / EXPORT_MARKER).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(
            f"export folder {out_dir} holds files and is not an exported drafter (no {EXPORT_MARKER} in it): give a "
            "new or empty folder"
        ) from None
    if present - written - {EXPORT_MARKER}:
        extra = ", ".join(sorted(present - written - {EXPORT_MARKER}))
        raise ConfigError(
            f"export folder {out_dir} is an earlier export with files added ({extra}): give a new or empty folder, "
            "or move them out"
        )


# --- the run's config.toml ------------------------------------------------------------------------------------


def write_config(cfg: TrainConfig, folder: Path) -> None:
    """``folder/config.toml``: every setting of the run but the invocation's own (see INVOCATION_FIELDS), by
    section, as a ``--config`` file takes them."""
    values = cfg.to_dict()
    lines = [
        "# The settings of this dflash_train run, resolved: what --resume continues with (flags given then change",
        "# them), and a --config file for a run like it. Not here, as they say what one invocation does:",
        "# " + ", ".join(TrainConfig.INVOCATION_FIELDS) + ".",
    ]
    for section in SECTIONS:
        lines += ["", f"# {section.__doc__}"]
        lines += [
            f"{f.name} = {_toml(values[f.name])}"
            for f in dataclasses.fields(section)
            if f.name not in TrainConfig.INVOCATION_FIELDS
        ]
    tmp = folder / (CONFIG + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, folder / CONFIG)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # Python's float repr (1e-05, inf) is TOML too
    return json.dumps(value, ensure_ascii=False)  # a TOML basic string


def saved_config(folder: Path) -> TrainConfig:
    """The config the run in ``folder`` was started with: its config.toml; for a run written before there was
    one, the config its checkpoint holds. Settings this version does not know are left out."""
    path = folder / CONFIG
    if path.is_file():
        values, source = read_config_file(str(path)), str(path)
    else:
        values, source = json.loads(_checkpoint_metadata(folder / CHECKPOINT)["train_config"]), str(folder / CHECKPOINT)
    known = {f.name for f in dataclasses.fields(TrainConfig)} - set(TrainConfig.INVOCATION_FIELDS)
    return make_config(TrainConfig(), {k: v for k, v in values.items() if k in known}, source)


def _checkpoint_metadata(path: Path) -> dict[str, str]:
    """The metadata of a safetensors file, read from its header (8 bytes of length, then JSON): no torch."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            return json.loads(f.read(length))["__metadata__"]
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise ConfigError(f"checkpoint {path} is corrupt or not a safetensors file ({e})") from e


def changes_since_start(cfg: TrainConfig) -> list[tuple[str, Any, Any]]:
    """(field, value at the start, value now) for each saved setting ``cfg`` changes in the run it resumes."""
    saved = saved_config(Path(cfg.out_dir)).to_dict()  # saved resolved
    now = cfg.to_dict()
    # The folder is the one given (the same run, maybe by another path); invocation fields are not saved.
    unsaved = {"out_dir", *TrainConfig.INVOCATION_FIELDS}
    return [(name, value, now[name]) for name, value in saved.items() if name not in unsaved and value != now[name]]


def resume_note(cfg: TrainConfig) -> str:
    """What a resumed run continues with, the changes named."""
    changes = changes_since_start(cfg)
    out = Path(cfg.out_dir)
    step = _checkpoint_metadata(out / CHECKPOINT).get("step", "?")
    note = f"resuming the run in {out} from step {step} with its settings ({out / CONFIG})"
    if not changes:
        return note
    note += "; changed: " + ", ".join(f"{_flag(name)} {old!r} -> {new!r}" for name, old, new in changes)
    if any(name in TrainConfig.TRAJECTORY_FIELDS for name, _, _ in changes):
        note += " (so it will not reproduce an uninterrupted run)"
    return note


def start_run(cfg: TrainConfig) -> None:
    """On rank 0, as the run starts: an --overwrite deletes the run in the folder; config.toml is (re)written."""
    out = Path(cfg.out_dir)
    if cfg.overwrite:
        for name in (CONFIG, METRICS, PLOT, CHECKPOINT):
            (out / name).unlink(missing_ok=True)
        shutil.rmtree(out / PROFILE, ignore_errors=True)
    write_config(cfg, out)


def continue_command(out_dir: Path, ranks: Ranks) -> str:
    """The command that continues the run in ``out_dir``, as this one was started (module or script)."""
    if ranks.launched:
        program = "torchrun <its options as before> -m dflash_train"
    elif Path(sys.argv[0]).name == "__main__.py":
        program = "python -m dflash_train"
    else:
        program = Path(sys.argv[0]).name  # the dflash-train script
    return f"{program} --resume --out-dir {shlex.quote(str(out_dir))}"
