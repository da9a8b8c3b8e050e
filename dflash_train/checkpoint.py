"""One safetensors file per run: the drafter's weights, the optimizer state, the step, and the configs
(``export`` turns one into the folder a serving stack loads).

Replicas are identical, so replica 0 speaks for all. The frozen embedding and LM head belong to the
target and are not stored. The file is written whole, to the disk, before it replaces the last one
(``files.save_safetensors``): an interrupted save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ConfigError, TrainConfig
from .files import save_safetensors
from .model import Drafter

FORMAT = "dflash_train.checkpoint/1"
# The drafter config entries that decide the weights' shapes and meaning.
DRAFTER_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "dflash_config",
)


def save_checkpoint(
    path: Path, drafter: Drafter, optimizer: torch.optim.Optimizer, step: int, cfg: TrainConfig, target_path: str
) -> None:
    tensors = {f"drafter.{k}": v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
    opt = optimizer.state_dict()
    for index, state in opt["state"].items():
        for name, value in state.items():
            tensors[f"optimizer.{index}.{name}"] = torch.as_tensor(value).detach().cpu().contiguous()
    metadata = {
        "format": FORMAT,
        "step": str(step),
        "train_config": cfg.to_json(),
        "drafter_config": json.dumps({k: drafter.config.to_dict()[k] for k in DRAFTER_KEYS}),
        # What `python -m dflash_train export` writes out: the whole drafter config, and the target it drafts for.
        "model_config": drafter.config.to_json_string(use_diff=False),
        "target_path": target_path,
        "optimizer_param_groups": json.dumps(opt["param_groups"]),
    }
    save_safetensors(path, tensors, metadata)


def load_checkpoint(
    path: Path, cfg: TrainConfig, replicas: list[Drafter], optimizers: list[torch.optim.Optimizer]
) -> int:
    """Load ``path`` into every replica and optimizer; return the number of steps it had done.

    Raises ConfigError, with one message, for a corrupt or incompatible checkpoint."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise ConfigError(f"checkpoint {path} is corrupt or not a safetensors file ({e})") from e
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a dflash_train checkpoint (format {meta.get('format')!r})")
    try:
        saved = json.loads(meta["train_config"])
        saved_drafter = json.loads(meta["drafter_config"])
        param_groups = json.loads(meta["optimizer_param_groups"])
        step = int(meta["step"])
    except (KeyError, ValueError) as e:
        raise ConfigError(f"checkpoint {path} is corrupt: bad metadata ({e})") from e

    for name in TrainConfig.MODEL_FIELDS:
        if saved.get(name) != getattr(cfg, name):
            flag = name.replace("_", "-")
            raise ConfigError(
                f"checkpoint {path} is incompatible with this run: it was trained with "
                f"--{flag} {saved.get(name)!r}, this run has --{flag} {getattr(cfg, name)!r}"
            )
    ours = {k: replicas[0].config.to_dict()[k] for k in DRAFTER_KEYS}
    for key in DRAFTER_KEYS:
        if saved_drafter.get(key) != ours[key]:
            raise ConfigError(
                f"checkpoint {path} is incompatible with this run's target: drafter {key} is "
                f"{saved_drafter.get(key)!r} there, {ours[key]!r} here"
            )
    weights = {k.removeprefix("drafter."): v for k, v in tensors.items() if k.startswith("drafter.")}
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        if k.startswith("optimizer."):
            _, index, name = k.split(".", 2)
            opt_state.setdefault(int(index), {})[name] = v
    try:
        for replica, optimizer in zip(replicas, optimizers):
            replica.load_state_dict(weights)
            # Cloned: load_state_dict keeps tensors already on the right device, and optimizers sharing
            # their moments would update them once per replica.
            state = {i: {name: v.clone() for name, v in s.items()} for i, s in opt_state.items()}
            optimizer.load_state_dict({"state": state, "param_groups": param_groups})
    except (RuntimeError, ValueError, KeyError) as e:
        raise ConfigError(f"checkpoint {path} does not fit this drafter: {e}") from e
    return step
