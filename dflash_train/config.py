"""The trainer's configuration: a dataclass per section, ``TrainConfig`` with them all, its command line, and
optional TOML/YAML files.

This module must not import torch: ``__main__`` parses the command line with it *before* torch is
imported, so that ``--no-torchfix`` can still switch the shim off.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILE_SPEC = re.compile(r"^(\d+):(\d+)$")


class ConfigError(Exception):
    """A user mistake (bad flag value, missing file, incompatible checkpoint): one clear message."""


@dataclass(frozen=True)
class Range:
    """The values a numeric setting may take, ``low`` (excluded with ``above``) to ``high``; ``TrainConfig.resolved``
    checks every field's."""

    low: float
    high: float = math.inf
    above: bool = False

    def holds(self, value: float) -> bool:
        return (value > self.low if self.above else value >= self.low) and value <= self.high

    def rule(self) -> str:
        """What the error message says the value must be."""
        if self.high < math.inf:
            return f"must be in [{self.low:g}, {self.high:g}]"
        if self.above:
            return f"must be above {self.low:g}" if self.low else "must be positive"
        return f"must be at least {self.low:g}" if self.low else "must not be negative"


AT_LEAST_1, NOT_NEGATIVE, POSITIVE, FRACTION = Range(1), Range(0), Range(0, above=True), Range(0, 1)


def _opt(default: Any, help: str, valid: Range | None = None, **extra: Any) -> Any:
    """A setting: its default, its --help text, the values it may take (checked after the automatic values are
    filled in), and argparse extras (``metavar``)."""
    return field(default=default, metadata={"help": help, "valid": valid, **extra})


@dataclass
class TargetSection:
    """target model and data"""

    target: str = _opt(
        "tiny",
        "target model: 'tiny' (a byte-level Qwen3 trained here on Python's standard library, cached) "
        "or the local path of a Hugging Face causal LM (model + tokenizer; nothing is downloaded)",
        metavar="PATH",
    )
    tiny_target_steps: int = _opt(
        600,
        "training steps of the tiny target (first run only; 0 keeps it randomly initialised)",
        valid=NOT_NEGATIVE,
    )
    data: str = _opt(
        "stdlib",
        "training text: 'stdlib' (this Python's standard-library sources) or a local text file / "
        "directory of text files",
        metavar="PATH",
    )
    regenerate: int = _opt(
        256,
        "train on this many samples written by the target (the DFlash recipe: the drafter learns what the target "
        "writes): one per training sequence, a prompt from the text (in the tokenizer's chat template if it has "
        "one), the target's greedy continuation to its own EOS, padding; only the continuation is supervised. "
        "Generated once and cached. 0: train on the text itself",
        valid=NOT_NEGATIVE,
    )
    cache_dir: str = _opt(
        str(Path.home() / ".cache" / "dflash_train"),
        "where the tiny target and regenerated data are cached (reruns skip making them)",
        metavar="PATH",
    )
    out_dir: str = _opt(
        "runs/dflash",
        "the run's folder: config.toml (the run's settings), metrics.jsonl, plot.png, checkpoint.safetensors; a "
        "folder that holds a run is refused unless --resume or --overwrite says what to do with it",
        metavar="PATH",
    )


@dataclass
class DevicesSection:
    """devices and threads"""

    target_devices: str = _opt(
        "cpu", "devices of the target workers, one thread each: 'cpu', 'cuda:0,cuda:1'", metavar="DEVICES"
    )
    drafter_devices: str = _opt(
        "cpu", "devices of the drafter replicas: 'cpu', 'cuda:0', 'cuda:0,cuda:1'", metavar="DEVICES"
    )
    drafter_threads_per_device: int = _opt(
        2, "drafter threads (data-parallel replicas) per drafter device", valid=AT_LEAST_1
    )
    queue_size: int = _opt(4, "bound of each drafter's queue of target hidden states (backpressure)", valid=AT_LEAST_1)
    cuda_streams: str = _opt(
        "per-thread",
        "CUDA streams of the worker threads: 'per-thread' (each its own, so that a target's forward of the next "
        "step runs on the GPU while the drafters step) or 'shared' (all on the device's default stream, one "
        "kernel after another)",
        metavar="HOW",
    )


@dataclass
class DrafterSection:
    """drafter and loss"""

    drafter_layers: int = _opt(
        2, "decoder layers of the DFlash drafter (also the number of tapped target layers)", valid=AT_LEAST_1
    )
    block_size: int = _opt(
        0, "tokens per draft block (anchor + mask tokens); 0: 8 for the tiny target, else 16", valid=Range(2)
    )
    loss_gamma: float = _opt(0.0, "decay of the loss weight exp(-(k-1)/gamma); 0: 7 for block 16, 4 for block 8")
    num_anchors: int = _opt(16, "anchors (draft blocks) sampled per sequence and step", valid=AT_LEAST_1)
    seq_len: int = _opt(256, "tokens per training sequence", valid=AT_LEAST_1)
    batch_size: int = _opt(8, "sequences per step, split across all drafter threads", valid=AT_LEAST_1)
    loss_chunk: int = _opt(
        8, "draft blocks per checkpointed chunk of the loss (full logits never exist at once)", valid=AT_LEAST_1
    )


@dataclass
class OptimSection:
    """optimisation"""

    steps: int = _opt(150, "optimizer steps of the drafter", valid=AT_LEAST_1)
    lr: float = _opt(3e-3, "peak learning rate (AdamW)", valid=POSITIVE)
    warmup_steps: int = _opt(15, "linear warm-up steps before the cosine decay", valid=NOT_NEGATIVE)
    min_lr_ratio: float = _opt(0.1, "final learning rate as a fraction of the peak", valid=FRACTION)
    weight_decay: float = _opt(0.01, "AdamW weight decay", valid=NOT_NEGATIVE)
    grad_clip: float = _opt(1.0, "clip the global gradient norm to this (0: no clipping)", valid=NOT_NEGATIVE)
    seed: int = _opt(0, "seed of initialisation, data order and anchor sampling")


@dataclass
class CompileSection:
    """compilation"""

    compile: bool = _opt(
        True,
        "torch.compile: on CUDA flex_attention + create_block_mask, on CPU the drafter layers (dense mask + "
        "SDPA); --no-compile: dense mask + SDPA, eager, everywhere",
    )
    backend: str = _opt(
        "inductor",
        "torch.compile backend of the drafter layers on CPU ('inductor', 'aot_eager', 'eager'); on CUDA, what is "
        "compiled (see --compile-mode) is always compiled with inductor",
        metavar="NAME",
    )
    compile_target: bool = _opt(
        True,
        "on CUDA (with --compile), compile the target's forward too (inductor, without CUDA graphs; its hidden "
        "states go to the drafter threads); --no-compile-target runs it eagerly",
    )
    compile_mode: str = _opt(
        "default",
        "torch.compile mode on CUDA drafters: 'default' (the layers eager, flex attention and its block mask "
        "compiled), 'reduce-overhead' (the drafter step's whole loss compiled, every layer with flex attention and "
        "its gradient checkpoint inside, and replayed as CUDA graphs), 'max-autotune-no-cudagraphs' (the same, "
        "autotuned, "
        "without CUDA graphs); only 'default' on CPU drafters",
        metavar="MODE",
    )


@dataclass
class EvalSection:
    """evaluation (acceptance length tau)"""

    eval_prompts: int = _opt(
        8, "held-out prompts for the acceptance length tau (0: skip evaluation)", valid=NOT_NEGATIVE
    )
    eval_prompt_len: int = _opt(64, "tokens per evaluation prompt")
    eval_new_tokens: int = _opt(96, "tokens generated per evaluation prompt")


@dataclass
class RunSection:
    """run control"""

    save_every: int = _opt(50, "save a checkpoint every N steps (0: only at the end)", valid=NOT_NEGATIVE)
    stop_after: int = _opt(
        0, "stop (with a checkpoint) after N steps of this run, keeping the schedule (0: off)", valid=NOT_NEGATIVE
    )
    tensorboard: str = _opt(
        "",
        "also write the metrics (loss, accuracy, lr, tokens/s, MFU, tau) as TensorBoard events to this folder "
        "(needs the tensorboard package); '': do not",
        metavar="PATH",
    )
    export: str = _opt(
        "",
        "after training, also write the drafter to this folder as DFlash serving code loads it (config.json, "
        "model.safetensors in bf16, README.md; what 'python -m dflash_train export RUN_DIR OUT_DIR' writes); '': "
        "do not",
        metavar="PATH",
    )
    resume: bool = _opt(
        False,
        "continue the run in --out-dir from its checkpoint (step, weights, optimizer state) with the settings it was "
        "started with (<out-dir>/config.toml): flags given again change them, and each change is named",
    )
    overwrite: bool = _opt(
        False, "start a new run in an --out-dir that holds one, deleting its checkpoint, metrics and plot"
    )
    watchdog_timeout: float = _opt(
        300.0,
        "seconds without progress before every thread's stack is printed and the job exits (0: off)",
        valid=NOT_NEGATIVE,
    )
    dist_timeout: float = _opt(
        600.0,
        "under torchrun: seconds a step's all-reduce waits for the other ranks before failing, so that a dead or "
        "stuck rank stops the job instead of hanging it",
        valid=AT_LEAST_1,
    )
    ranks_share_devices: bool = _opt(
        False,
        "under torchrun: every rank uses the devices as named (no per-local-rank shift), and the ranks' all-reduce "
        "goes over gloo, since NCCL cannot put two ranks on one GPU (one process per replica on a shared GPU)",
    )
    profile_steps: str = _opt(
        "",
        "profile the job with torch.profiler (every thread's ops, and the CUDA kernels on GPU) from the end of step "
        "FIRST to the end of step LAST, on rank 0; writes <out-dir>/profile/ (trace.json, ops.txt, ops.json); '': "
        "do not",
        metavar="FIRST:LAST",
    )
    progress: bool = _opt(
        True, "a progress bar on a terminal; --no-progress, or output to a file: a line every --log-every steps"
    )
    log_every: int = _opt(
        10, "without a progress bar: print the step, loss, accuracy and tokens/s every N steps", valid=AT_LEAST_1
    )


# The sections' order in --help; TrainConfig lists them the other way round, since a dataclass takes the fields
# of its last base first.
SECTIONS = (TargetSection, DevicesSection, DrafterSection, OptimSection, CompileSection, EvalSection, RunSection)


@dataclass
class TrainConfig(RunSection, EvalSection, CompileSection, OptimSection, DrafterSection, DevicesSection, TargetSection):
    """The whole configuration: the sections' fields side by side, as the flags and config files name them."""

    # Fields that decide the drafter's shapes and what its weights mean: a checkpoint is only
    # compatible with a config that agrees on all of them.
    MODEL_FIELDS = ("target", "drafter_layers", "block_size")
    # Fields that say what one invocation does rather than what the run is: not saved in the run's config.toml,
    # so --resume does not inherit them (a --stop-after 2 stops the invocation that gave it, not every resume).
    # Settings that change the training trajectory without changing the drafter's shape: a resume that changes
    # one works, but no longer reproduces the uninterrupted run.
    TRAJECTORY_FIELDS = (
        "tiny_target_steps",
        "data",
        "regenerate",
        "seed",
        "steps",
        "lr",
        "warmup_steps",
        "min_lr_ratio",
        "weight_decay",
        "grad_clip",
        "batch_size",
        "seq_len",
        "num_anchors",
        "loss_gamma",
    )
    INVOCATION_FIELDS = ("resume", "overwrite", "stop_after", "profile_steps")

    def resolved(self) -> TrainConfig:
        """Fill the automatic values (block size, gamma) and check ranges; raise ConfigError."""
        cfg = dataclasses.replace(self)
        if cfg.block_size == 0:
            cfg.block_size = 8 if cfg.target == "tiny" else 16
        if cfg.loss_gamma == 0:
            # The DFlash recipe: gamma 7 for block 16, 4 for block 8; linear in between and beyond.
            cfg.loss_gamma = max(1.0, 4.0 + 3.0 * (cfg.block_size - 8) / 8)
        for f in _fields():  # each field's range, beside it
            value, valid = getattr(cfg, f.name), f.metadata["valid"]
            if valid is not None and not valid.holds(value):
                raise ConfigError(f"--{_flag(f.name)} {valid.rule()} (got {value})")
        if cfg.seq_len < cfg.block_size + 1:
            raise ConfigError(f"--seq-len ({cfg.seq_len}) must exceed --block-size ({cfg.block_size})")
        parse_devices(cfg.target_devices, "--target-devices")
        check_compile_mode(cfg)
        if cfg.cuda_streams not in CUDA_STREAMS:
            raise ConfigError(f"--cuda-streams {cfg.cuda_streams!r}: use {' or '.join(map(repr, CUDA_STREAMS))}")
        if cfg.profile_steps and cfg.profile_window() is None:
            raise ConfigError(
                f"--profile-steps {cfg.profile_steps!r}: use FIRST:LAST with 1 <= FIRST < LAST <= --steps ({cfg.steps})"
            )
        if cfg.resume and cfg.overwrite:
            raise ConfigError("--resume continues the run in --out-dir and --overwrite replaces it: give one of them")
        if cfg.target == "tiny":
            tap_layer_ids(TINY_TARGET_LAYERS, cfg.drafter_layers)  # refuses more drafter layers than it has to tap
        replicas = Ranks.from_env().world_size * cfg.drafter_thread_count()
        if cfg.batch_size % replicas != 0:
            raise ConfigError(
                f"--batch-size ({cfg.batch_size}) must be divisible by the number of drafter threads of the job "
                f"({replicas} = ranks x devices x --drafter-threads-per-device)"
            )
        return cfg

    def profile_window(self) -> tuple[int, int] | None:
        """``--profile-steps FIRST:LAST`` as (FIRST, LAST); None when it is off or not such a window."""
        match = PROFILE_SPEC.match(self.profile_steps.strip())
        if match is None or not 1 <= int(match[1]) < int(match[2]) <= self.steps:
            return None
        return int(match[1]), int(match[2])

    def drafter_thread_count(self) -> int:
        return len(parse_devices(self.drafter_devices, "--drafter-devices")) * self.drafter_threads_per_device

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


@dataclass(frozen=True)
class Ranks:
    """Where this process sits in a ``torchrun`` job; one rank of one without torchrun.

    torch.distributed.run tells each process through environment variables: no flag turns it on."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  # the rank among the processes of this host
    local_world_size: int = 1
    launched: bool = False  # by torchrun (even as one rank: the process group still starts)

    @classmethod
    def from_env(cls) -> Ranks:
        env = os.environ
        if "WORLD_SIZE" not in env:
            return cls()
        return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"]), True)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1


# The tiny target's depth (target.TINY_QWEN3): five layers, so that a two-layer drafter taps two distinct layers (1, 2).
TINY_TARGET_LAYERS = 5


def tap_layer_ids(num_target_layers: int, num_drafter_layers: int) -> list[int]:
    """The DFlash layer-selection rule (z-lab/dflash's build_target_layer_ids): one tapped target layer per drafter
    layer, evenly spaced from layer 1 to layer L-3 (the last layers are too specialised to the next token); a single
    drafter layer taps the middle layer. Raises ConfigError where that range has fewer layers than the drafter: the
    rule would tap a layer twice (5 target layers, 3 drafter layers: [1, 2, 2])."""
    if num_drafter_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end - start + 1 < num_drafter_layers:
        raise ConfigError(
            f"--drafter-layers {num_drafter_layers}: a drafter taps as many distinct target layers, from layer 1 to "
            f"L-3, and the {num_target_layers}-layer target has {max(0, end - start + 1)} there: use "
            f"--drafter-layers {max(1, end - start + 1)} or fewer"
        )
    return [round(start + i * (end - start) / (num_drafter_layers - 1)) for i in range(num_drafter_layers)]


def parse_devices(spec: str, flag: str) -> list[str]:
    """'cpu' / 'cuda:0,cuda:1' -> ['cuda:0', 'cuda:1']; only the syntax is checked here (no torch)."""
    devices = [d.strip() for d in spec.split(",") if d.strip()]
    if not devices:
        raise ConfigError(f"{flag} is empty")
    for d in devices:
        kind, _, index = d.partition(":")
        if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and index):
            raise ConfigError(f"{flag}: '{d}' is not a device (use 'cpu', 'cuda' or 'cuda:N')")
    return devices


# --cuda-streams values (streams.py, which needs torch, does the work).
CUDA_STREAMS = ("per-thread", "shared")

# torch.compile(mode=...) values the trainer takes; all but 'default' compile the drafter layers on CUDA.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")


def check_compile_mode(cfg: TrainConfig) -> None:
    """--compile-mode: a known mode, and one that means something for this run (no torch needed)."""
    mode = cfg.compile_mode
    if mode not in COMPILE_MODES:
        raise ConfigError(f"--compile-mode {mode!r}: use {', '.join(repr(m) for m in COMPILE_MODES)}")
    if mode == "default":
        return
    if not cfg.compile:
        raise ConfigError(f"--compile-mode {mode} compiles the drafter layers: it cannot go with --no-compile")
    if all(d.startswith("cpu") for d in parse_devices(cfg.drafter_devices, "--drafter-devices")):
        raise ConfigError(
            f"--compile-mode {mode} is for CUDA drafters, and the drafter devices are {cfg.drafter_devices!r}: on the "
            "CPU the drafter layers are compiled as --backend says (and CUDA graphs exist only on CUDA)"
        )


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _fields() -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(TrainConfig)


def build_parser() -> argparse.ArgumentParser:
    """The command line: one flag per config field, plus --config and --no-torchfix.

    Defaults are suppressed so that the namespace holds only the flags actually given: they
    override the config file, which overrides the defaults.
    """
    parser = argparse.ArgumentParser(
        prog="dflash-train",
        description="Train a DFlash (block-diffusion speculative decoding) drafter for a causal LM, with one "
        "Python thread per drafter replica fed by target-model threads. With no flags: a ~5 minute CPU demo.",
        epilog="Serving the trained drafter: 'python -m dflash_train export RUN_DIR OUT_DIR' writes a run's drafter "
        "as the folder DFlash inference code (z-lab/dflash, SGLang, vLLM) loads ('python -m dflash_train export "
        "--help' for its options).",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--config", metavar="PATH", help="TOML or YAML file of settings (keys as the flags, '-' or '_')"
    )
    parser.add_argument(
        "--no-torchfix",
        action="store_true",
        help="run without the torchfix shim (same as TORCHFIX_DISABLE=1), to see what it prevents",
    )
    for section in SECTIONS:  # one --help group each
        group = parser.add_argument_group(section.__doc__)
        for f in dataclasses.fields(section):
            kwargs: dict[str, Any] = {"help": f"{f.metadata['help']} (default: {f.default!r})"}
            if f.type == "bool":
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = {"int": int, "float": float, "str": str}[f.type]
                kwargs["metavar"] = f.metadata.get("metavar", {"int": "N", "float": "X", "str": "STR"}[f.type])
            group.add_argument(f"--{_flag(f.name)}", dest=f.name, **kwargs)
    return parser


def read_config_file(path: str) -> dict[str, Any]:
    """Settings from a .toml / .yaml / .yml file, keys as field names (dashes allowed)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        if p.suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib
            data = tomllib.loads(p.read_text())
        elif p.suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ModuleNotFoundError as e:
                raise ConfigError("YAML config files need PyYAML (pip install pyyaml); or use TOML") from e
            data = yaml.safe_load(p.read_text()) or {}
        else:
            raise ConfigError(f"config file {path}: use a .toml, .yaml or .yml file")
    except ConfigError:
        raise
    except Exception as e:  # the parsers' own errors carry line numbers
        raise ConfigError(f"config file {path} is not valid: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a table of settings")
    return {k.replace("-", "_"): v for k, v in data.items()}


def make_config(base: TrainConfig, overrides: dict[str, Any], source: str) -> TrainConfig:
    """``base`` with ``overrides`` applied; unknown keys and wrongly typed values raise ConfigError."""
    known = {f.name: f for f in _fields()}
    values = {}
    for key, value in overrides.items():
        if key not in known:
            raise ConfigError(f"{source}: unknown setting '{key}'")
        want = {"int": int, "float": float, "str": str, "bool": bool}[known[key].type]
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise ConfigError(f"{source}: '{key}' must be {want.__name__}, got {value!r}")
        values[key] = value
    return dataclasses.replace(base, **values)
