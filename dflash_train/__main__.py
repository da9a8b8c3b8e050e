"""``python -m dflash_train`` / ``dflash-train``: the command line of the trainer.

The order matters: parse and check the flags and paths without importing torch (a mistake is one line in the
first second, not a traceback after torch's import or the target's training), honour ``--no-torchfix`` by
setting ``TORCHFIX_DISABLE=1``, then ``import torchfix`` (the one line that makes threaded compilation safe),
and only then import torch and the trainer.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, NoReturn

from . import run_dir
from .config import ConfigError, Ranks, TrainConfig, build_parser, make_config, read_config_file
from .files import OutOfSpace, private_compile_caches

EXIT_FAILED, EXIT_USAGE = 1, 2
# What the trainer imports beyond torchfix's own dependencies: the `train` extra (pyproject.toml).
TRAIN_EXTRA = ("transformers", "safetensors", "tqdm", "matplotlib")


def exit_status(signum: int) -> int:
    """A process stopped by a signal exits as the shell reports one killed by it: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signum


def command_line_config(config_file: str | None, flags: dict[str, Any]) -> TrainConfig:
    """The run's config: the defaults, the --config file, the flags; with --resume, the resumed run's saved
    settings in place of the defaults. Resolved, its paths checked; no torch. Raises ConfigError."""
    given = [(flags, "command line")]
    if config_file is not None:
        given.insert(0, (read_config_file(config_file), config_file))

    def apply(cfg: TrainConfig) -> TrainConfig:
        for values, source in given:
            cfg = make_config(cfg, values, source)
        return cfg

    cfg = apply(TrainConfig())
    if cfg.resume and (Path(cfg.out_dir) / run_dir.CHECKPOINT).is_file():
        cfg = apply(run_dir.saved_config(Path(cfg.out_dir)))
    cfg = cfg.resolved()
    run_dir.check_paths(cfg)
    return cfg


def check_train_extra() -> None:
    """The modules of the `train` extra are installed, or one ConfigError says how to install them."""
    missing = []
    for name in TRAIN_EXTRA:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # ValueError: sys.modules holds None for it (an import blocked)
            found = False
        if not found:
            missing.append(name)
    if missing:
        raise ConfigError(
            f"the trainer needs the 'train' extra, which is not installed (no {', '.join(missing)}): "
            "pip install -e '.[train]' in a checkout of torchfix"
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"]:
        return export_main(argv[1:])
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    if args.pop("no_torchfix", False):
        os.environ["TORCHFIX_DISABLE"] = "1"
    # Several Python threads drive their own OpenMP teams on the CPU; spinning OpenMP threads then
    # starve each other (and any other process), making steps up to 10x slower. Read at torch import.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    config_file = args.pop("config", None)
    ranks = Ranks.from_env()
    # Under torchrun every rank reports its own failure; rank 0 alone reports the rest.
    me = f"dflash-train (rank {ranks.rank})" if ranks.world_size > 1 else "dflash-train"
    try:
        check_train_extra()
        cfg = command_line_config(config_file, args)
        private_compile_caches(cfg.cache_dir)  # before torch is imported: Inductor reads it then
    except ConfigError as e:
        parser.exit(EXIT_USAGE, f"{me}: error: {e}\n")

    import torchfix  # noqa: F401  (the whole answer to threads + torch.compile; see README)

    from .train import train
    from .workers import WorkerFailed

    try:
        result = train(cfg)
    except ConfigError as e:
        parser.exit(EXIT_USAGE, f"{me}: error: {e}\n")
    except WorkerFailed as e:
        print(f"{me}: {e}", file=sys.stderr)
        return EXIT_FAILED
    except OutOfSpace as e:
        print(f"{me}: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt as e:  # a second stop signal (workers.Interrupted), or Ctrl-C outside the training
        print(f"{me}: interrupted", file=sys.stderr, flush=True)
        status = exit_status(getattr(e, "signum", signal.SIGINT))
        if threading.active_count() > 1:
            # Quit at once, workers and all: tearing the interpreter down under a thread still inside a
            # torch op can abort the process ("terminate called without an active exception").
            sys.stdout.flush()
            os._exit(status)
        return status
    if not ranks.is_main:
        # Even when interrupted: torchrun stops every rank when one exits non-zero, and rank 0 may still be
        # writing its checkpoint. Rank 0's exit status speaks for the job.
        return 0
    if result.interrupted:
        print(
            f"dflash-train: interrupted at step {result.steps_done}; checkpoint saved in {result.out_dir}. "
            f"Continue it with: {run_dir.continue_command(result.out_dir, ranks)}",
            file=sys.stderr,
        )
        return exit_status(result.stop_signal or signal.SIGINT)
    print(result.summary(), flush=True)
    if result.steps_done < cfg.steps:  # --stop-after
        print(
            f"stopped at step {result.steps_done} of {cfg.steps}; continue with: "
            f"{run_dir.continue_command(result.out_dir, ranks)}",
            flush=True,
        )
    return 0


def export_main(argv: list[str]) -> int:
    """``dflash-train export RUN_DIR OUT_DIR``: a run's checkpoint as the folder DFlash serving code loads."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="dflash-train export",
        description="Write a run's drafter (RUN_DIR/checkpoint.safetensors) as a Hugging Face style folder: "
        "config.json and model.safetensors in the layout of DFlash inference code (z-lab/dflash, SGLang, vLLM), and "
        "README.md, a model card with their launch settings.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the --out-dir of a dflash_train run")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the folder to write (replaced if it is an earlier export)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="(default: bfloat16)")
    args = parser.parse_args(argv)
    try:
        run = Path(args.run_dir)
        if not run.is_dir():
            raise ConfigError(f"RUN_DIR {run} {'is not a folder' if run.exists() else 'does not exist'}")
        run_dir.check_folder(args.out_dir, "OUT_DIR", create=False)
        run_dir.check_export_folder(Path(args.out_dir))
        check_train_extra()
        from .export import export_run

        out = export_run(args.run_dir, args.out_dir, dtype=args.dtype)
    except ConfigError as e:
        parser.exit(EXIT_USAGE, f"dflash-train export: error: {e}\n")
    print(f"exported {args.run_dir} to {out}: config.json, model.safetensors, README.md")
    return 0


def leave(status: int) -> NoReturn:
    """Exit with ``status`` as ``sys.exit`` would, less the interpreter's teardown: once no other thread runs, the
    at-exit handlers run and the output is flushed, then the process ends. Tearing down torch's and transformers'
    modules took 1.5 - 2 CPU seconds at the end of every run (and, on some torch releases, can abort the process
    after a threaded compile); everything the run writes is written and closed by then."""
    if threading.active_count() > 1:
        sys.exit(status)  # a thread still runs: let the interpreter wait for it, as it always does
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)


def run() -> NoReturn:
    """``python -m dflash_train`` and the ``dflash-train`` script."""
    leave(main())


if __name__ == "__main__":
    run()
