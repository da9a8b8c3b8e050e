"""A trained drafter as the folder DFlash inference code loads: ``config.json`` and ``model.safetensors``.

The layout is the reference one (z-lab/dflash's ``DFlashDraftModel``, which SGLang and vLLM follow): the
attention projections and norms of layer i under ``layers.{i}.self_attn.``, the rest as the drafter names
them (``layers.{i}.mlp.*``, the two layer norms, ``fc``, ``hidden_norm``, ``norm``); no optimizer state, no
embedding or LM head (they are the target's). ``config.json`` is the drafter's Qwen3 config with what that
code reads: ``architectures``, ``block_size``, ``num_target_layers`` and ``dflash_config`` (``mask_token_id``,
``target_layer_ids``), the rope settings copied from the target, and under ``dflash_train`` the target and the
tokenizer it was trained with.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Qwen3Config

from .checkpoint import FORMAT
from .config import ConfigError
from .model import Drafter
from .target import Target

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
WEIGHTS, CONFIG = "model.safetensors", "config.json"
# Written last into every export: the names of the files it wrote. A folder holding it and only those files is
# an earlier export, which a new one may replace; export writes into no other folder that is not empty.
MARKER = ".dflash_train_export.json"
# A drafter layer's attention parts, which the reference nests in ``self_attn``.
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


def reference_key(name: str) -> str:
    """``layers.0.q_proj.weight`` -> ``layers.0.self_attn.q_proj.weight``; other keys as they are."""
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) > 2 and parts[2] in _ATTENTION:
        parts.insert(2, "self_attn")
    return ".".join(parts)


def drafter_key(name: str) -> str:
    """The inverse of :func:`reference_key`."""
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) > 3 and parts[2] == "self_attn":
        del parts[2]
    return ".".join(parts)


def write_export(
    config: Qwen3Config, weights: dict[str, torch.Tensor], out_dir: Path, *, target_path: str, dtype: str = "bfloat16"
) -> Path:
    """Write the folder. It appears whole or not at all: written next to ``out_dir``, then renamed over it."""
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: use {' or '.join(DTYPES)}")
    out_dir = Path(out_dir)
    check_export_folder(out_dir)
    config = Qwen3Config.from_dict(config.to_dict())  # a copy: the live drafter's config stays as it is
    config.dtype = dtype
    config.dflash_train = {"target": target_path, "tokenizer": _tokenizer_of(target_path)}
    tensors = {reference_key(k): v.detach().to("cpu", DTYPES[dtype]).contiguous() for k, v in weights.items()}
    tmp = _new_sibling(out_dir, "tmp")
    tmp.mkdir(parents=True)
    config.to_json_file(tmp / CONFIG, use_diff=False)
    save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
    (tmp / MARKER).write_text(json.dumps({"written_by": "dflash_train export", "files": sorted(os.listdir(tmp))}))
    if out_dir.exists():  # empty or an earlier export (checked above): a rename cannot replace a folder
        old = _new_sibling(out_dir, "old")
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out_dir)
    return out_dir


def _new_sibling(folder: Path, what: str) -> Path:
    """A name beside ``folder`` that nothing has."""
    return folder.with_name(f".{folder.name}.{what}-{uuid.uuid4().hex[:12]}")


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
        written = set(json.loads((out_dir / MARKER).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(
            f"export folder {out_dir} holds files and is not an exported drafter (no {MARKER} in it): give a new or "
            "empty folder"
        ) from None
    if present - written - {MARKER}:
        extra = ", ".join(sorted(present - written - {MARKER}))
        raise ConfigError(
            f"export folder {out_dir} is an earlier export with files added ({extra}): give a new or empty folder, "
            "or move them out"
        )


def _tokenizer_of(target_path: str) -> str:
    """Where the drafter's tokenizer is: the target's folder, or the tiny target's byte-level tokenizer."""
    has_files = any((Path(target_path) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    return target_path if has_files else "dflash_train.data.ByteTokenizer (bytes 0 - 255, then the special tokens)"


def export_run(run_dir: Path, out_dir: Path, *, dtype: str = "bfloat16") -> Path:
    """``RUN_DIR/checkpoint.safetensors`` -> the exported folder. Raises ConfigError, with one message, for a
    missing, corrupt or too old checkpoint."""
    ckpt = Path(run_dir) / "checkpoint.safetensors"
    if not ckpt.is_file():
        raise ConfigError(f"{run_dir}: no checkpoint.safetensors (the output folder of a dflash_train run)")
    try:
        with safe_open(str(ckpt), framework="pt") as f:
            meta = f.metadata() or {}
            weights = {k.removeprefix("drafter."): f.get_tensor(k) for k in f.keys() if k.startswith("drafter.")}
    except Exception as e:
        raise ConfigError(f"checkpoint {ckpt} is corrupt or not a safetensors file ({e})") from e
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{ckpt} is not a dflash_train checkpoint (format {meta.get('format')!r})")
    if "model_config" not in meta:
        raise ConfigError(
            f"{ckpt} predates export (no model_config in it): continue the run once with --resume "
            "--stop-after 1 to rewrite it, then export"
        )
    try:
        config = Qwen3Config.from_dict(json.loads(meta["model_config"]))
    except ValueError as e:
        raise ConfigError(f"checkpoint {ckpt} is corrupt: bad model_config ({e})") from e
    return write_export(config, weights, out_dir, target_path=meta.get("target_path", ""), dtype=dtype)


def load_exported(folder: Path, target: Target) -> Drafter:
    """A drafter from an exported folder alone, on the target's device, with the target's frozen embedding
    and LM head; in float32, as training keeps it."""
    folder = Path(folder)
    try:
        config = Qwen3Config.from_pretrained(folder, local_files_only=True)
        with safe_open(str(folder / WEIGHTS), framework="pt") as f:
            weights = {drafter_key(k): f.get_tensor(k).float() for k in f.keys()}
    except (OSError, ValueError) as e:
        raise ConfigError(f"{folder}: not an exported drafter ({e})") from e
    drafter = Drafter(config, target.input_embeddings(), target.output_head())
    drafter.load_state_dict(weights)
    return drafter.to(target.device)
