"""The frozen target model: a local Hugging Face causal LM, or a tiny byte-level Qwen3 trained here.

The target workers only need one thing from it: the hidden states of the tapped layers,
concatenated (DFlash's context feature). Evaluation also needs its logits.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.utils import logging as hf_logging

from .config import TINY_TARGET_LAYERS, ConfigError, TrainConfig, tap_layer_ids
from .data import ByteTokenizer, Corpus, HFTokenizer, Tokenizer, TrainingData, batch_for_step
from .files import save_safetensors
from .report import Progress

# Loading and saving print their own progress bars; ours (target training, drafter steps) say more.
hf_logging.disable_progress_bar()


def compute_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPU (weights of the frozen target, autocast of the drafter), fp32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class Target:
    """A frozen causal LM on one device."""

    def __init__(self, model: PreTrainedModel, tap_ids: list[int]):
        self.model = model.eval().requires_grad_(False)
        self.device = next(model.parameters()).device
        self.tap_ids = tap_ids
        n_layers = model.config.num_hidden_layers
        if max(tap_ids) >= n_layers:
            raise ConfigError(f"tapped layers {tap_ids} do not exist in a {n_layers}-layer target")
        self.trunk = _trunk(model.base_model, max(tap_ids) + 1)
        self.trunk_layers = len(self.trunk.layers) if hasattr(self.trunk, "layers") else n_layers

    def compile_features(self) -> None:
        """Compile the forward of ``features`` (by inductor, without CUDA graphs: the hidden states it returns
        are handed to the drafter threads and must not be overwritten by the next step's replay)."""
        self.trunk = torch.compile(self.trunk)

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    def input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def output_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def _taps(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        # hidden_states[0] is the embedding output; layer i's output is hidden_states[i + 1].
        return torch.cat([hidden_states[i + 1] for i in self.tap_ids], dim=-1)

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, S] -> the concatenated tapped hidden states, [B, S, k * hidden]. Skips the LM head."""
        out = self.trunk(input_ids.to(self.device), output_hidden_states=True)
        return self._taps(out.hidden_states)

    @torch.no_grad()
    def logits_and_features(self, input_ids: torch.Tensor, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of the ``last`` positions [B, last, V] and the features of all positions."""
        out = self.model(input_ids.to(self.device), output_hidden_states=True, logits_to_keep=last)
        return out.logits.float(), self._taps(out.hidden_states)


def _trunk(base: nn.Module, layers: int) -> nn.Module:
    """``base`` (the decoder without its LM head) cut after its first ``layers`` layers, sharing the weights: the
    features need no later layer (in the 839 M benchmark target, 2 of 16). Its final norm is dropped too, since
    transformers reports the last hidden state after that norm and the last kept layer may be tapped. A model
    without ``layers`` and ``norm`` runs whole."""
    kept = getattr(base, "layers", None)
    if not isinstance(kept, nn.ModuleList) or not isinstance(getattr(base, "norm", None), nn.Module):
        return base
    if layers >= len(kept):
        return base
    # transformers records hidden states by hooks it puts on the layers at a model's first forward, marking that
    # model hooked: a copy made before would hook the shared layers again, and every model using them would then
    # record each layer twice. One forward first, so that the copy is born marked.
    with torch.no_grad():
        base(torch.zeros(1, 1, dtype=torch.long, device=next(base.parameters()).device), output_hidden_states=True)
    trunk = copy.copy(base)
    trunk._modules = dict(base._modules)  # its own module table; the modules (and weights) stay shared
    trunk.layers = nn.ModuleList(base.layers[:layers])
    trunk.norm = nn.Identity()
    return trunk


# --- the tiny byte-level target -------------------------------------------------------------------

# Small enough to learn the shape of Python source in a couple of minutes on two CPU cores.
TINY_QWEN3 = dict(
    vocab_size=ByteTokenizer.vocab_size,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=TINY_TARGET_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)
# In the tiny target's folder: its training steps and final loss (and that it is the tiny target).
TINY_MARKER = "dflash_train.json"
TINY_RECIPE = dict(batch_size=8, seq_len=128, lr=1e-2, warmup=20, min_lr_ratio=0.1, weight_decay=0.01)


def _tiny_target_dir(cfg: TrainConfig, corpus: Corpus) -> Path:
    key = json.dumps(
        dict(
            model=TINY_QWEN3,
            recipe=TINY_RECIPE,
            steps=cfg.tiny_target_steps,
            seed=cfg.seed,
            data=cfg.data,
            tokens=len(corpus.train),
            python=sys.version_info[:2],
        ),
        sort_keys=True,
    )
    return Path(cfg.cache_dir).expanduser() / f"tiny-target-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def train_tiny_target(cfg: TrainConfig, corpus: Corpus, device: torch.device, out: Path) -> None:
    """Train the tiny target as an ordinary causal LM, and save it where the cache expects it."""
    r = TINY_RECIPE
    torch.manual_seed(cfg.seed)
    model = Qwen3ForCausalLM(Qwen3Config(**TINY_QWEN3)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=r["lr"], betas=(0.9, 0.95), weight_decay=r["weight_decay"])
    steps = cfg.tiny_target_steps
    show = Progress("tiny target", steps, bar=cfg.progress and steps > 0, every=max(1, steps // 10))
    loss_ema = None
    for step in range(steps):
        progress = max(0, step - r["warmup"]) / max(1, steps - r["warmup"])
        scale = min(1.0, (step + 1) / r["warmup"]) * (
            r["min_lr_ratio"] + (1 - r["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * progress))
        )
        for group in opt.param_groups:
            group["lr"] = r["lr"] * scale
        x = batch_for_step(corpus.train, step, r["batch_size"], r["seq_len"], seed=cfg.seed + 7919).to(device)
        loss = model(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        show.update(step + 1, {"bits/byte": f"{loss_ema / math.log(2):.2f}"})
    show.close()
    # Show that it learnt something: a sampled continuation (greedy decoding of so small a model loops).
    torch.manual_seed(cfg.seed)
    prompt = torch.tensor([ByteTokenizer().encode("def ")], device=device)
    sample = model.generate(
        prompt,
        generation_config=GenerationConfig(max_new_tokens=120, do_sample=True, temperature=0.7, top_k=0, top_p=1.0),
    )
    bits = (loss_ema or 0) / math.log(2)
    print(f"tiny target: {bits:.2f} bits/byte; a sample: {ByteTokenizer().decode(sample[0].tolist())!r}")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    (tmp / TINY_MARKER).write_text(json.dumps({"steps": steps, "final_loss": loss_ema}))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def _damage(cached: Path) -> str | None:
    """What keeps a cached tiny target from loading (a file cut short by a crash, say); None if nothing."""
    try:
        json.loads((cached / "config.json").read_text())
        with safe_open(str(cached / "model.safetensors"), framework="pt"):
            pass  # opening checks that the file holds all the tensors its header lists
    except (OSError, ValueError, SafetensorError) as e:
        return str(e)
    return None


def prepare_target(cfg: TrainConfig, device: torch.device) -> tuple[str, Tokenizer, Corpus]:
    """The target's local folder, its tokenizer, and the training text tokenised with it.

    For 'tiny' the folder is in the cache, trained first (on ``device``) if it is not there yet:
    it learns from the same text the drafter is then trained on.
    """
    if cfg.target == "tiny":
        tokenizer: Tokenizer = ByteTokenizer()
        corpus = Corpus.load(cfg.data, tokenizer)
        path = _tiny_target_dir(cfg, corpus)
        damage = _damage(path)
        if damage is not None:
            if path.exists():
                print(f"dflash-train: warning: the cached tiny target {path} is damaged ({damage})", file=sys.stderr)
            print(f"training the tiny target ({cfg.tiny_target_steps} steps), cached in {path}", flush=True)
            train_tiny_target(cfg, corpus, device, path)
        return str(path), tokenizer, corpus
    if not (Path(cfg.target) / "config.json").is_file():
        raise ConfigError(f"--target {cfg.target}: not a local Hugging Face model folder (no config.json)")
    rows = AutoConfig.from_pretrained(cfg.target, local_files_only=True).vocab_size
    tokenizer = HFTokenizer(cfg.target, rows)
    return cfg.target, tokenizer, Corpus.load(cfg.data, tokenizer)


# --- training data written by the target ------------------------------------------------------------

REGEN_BATCH = 64


def _fingerprint(path: str) -> list:
    """Names, sizes and mtimes of a model folder's files: changes when its weights do."""
    files = sorted(p for p in Path(path).iterdir() if p.is_file())
    return [(p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in files]


def regenerate(
    cfg: TrainConfig, target: Target, target_path: str, corpus: Corpus, tokenizer: Tokenizer
) -> TrainingData:
    """The DFlash recipe's training data: the target's own greedy continuations of prompts from the text.

    A draft token is accepted when it is what the target would have written, so the drafter learns what the
    target writes, not what the text says. ``cfg.regenerate`` samples of ``seq_len`` tokens, one per training
    sequence: a prompt (a quarter of ``seq_len`` of the text, in the tokenizer's chat template where it has
    one), the target's greedy continuation up to its own EOS (included) or the end of the row, then padding.
    Only the continuation is supervised. Generated once per (target, text, sizes, chat template) and cached.
    """
    seq_len, eos, pad = cfg.seq_len, tokenizer.eos_token_id, tokenizer.pad_token_id
    key = json.dumps(
        dict(
            recipe="samples/2",  # one sample per row, natural EOS, loss mask (the cache of a token stream before)
            target=_fingerprint(target_path),
            data=cfg.data,
            text_tokens=len(corpus.train),
            n=cfg.regenerate,
            seq_len=seq_len,
            seed=cfg.seed,
            prompt_format=tokenizer.prompt_format(),
            eos=eos,
            pad=pad,
        ),
        sort_keys=True,
    )
    cached = (
        Path(cfg.cache_dir).expanduser() / f"regenerated-{hashlib.sha256(key.encode()).hexdigest()[:12]}.safetensors"
    )
    if cached.is_file():
        try:
            saved = load_file(cached)
            return TrainingData(saved["input_ids"], saved["supervised"].bool())
        except (SafetensorError, KeyError) as e:
            print(f"dflash-train: warning: the cached data {cached} is damaged ({e}); making it again", file=sys.stderr)
    rows, masks = [], []
    batches = range(0, cfg.regenerate, REGEN_BATCH)
    show = Progress("regenerating data", len(batches), bar=cfg.progress, every=1, unit="batch")
    for done, i in enumerate(batches, 1):
        size = min(REGEN_BATCH, cfg.regenerate - i)
        texts = batch_for_step(corpus.train, i, size, seq_len // 4, seed=cfg.seed + 104729)
        prompts = [tokenizer.prompt(t.tolist())[: seq_len - 1] for t in texts]
        longest = max(len(p) for p in prompts)
        # Left-padded, so that every row's continuation starts at column ``longest``.
        ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts], device=target.device)
        attention = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=target.device)
        generation = GenerationConfig(
            max_new_tokens=seq_len - min(len(p) for p in prompts), do_sample=False, pad_token_id=pad, eos_token_id=eos
        )
        with torch.no_grad():
            out = target.model.generate(ids, attention_mask=attention, generation_config=generation)
        for prompt, written in zip(prompts, out[:, longest:].tolist()):
            if eos in written:
                written = written[: written.index(eos) + 1]  # its own EOS is supervised; what follows is padding
            written = written[: seq_len - len(prompt)]
            filler = seq_len - len(prompt) - len(written)
            rows.append(prompt + written + [pad] * filler)
            masks.append([False] * len(prompt) + [True] * len(written) + [False] * filler)
        show.update(done, {})
    show.close()
    data = TrainingData(torch.tensor(rows, dtype=torch.long), torch.tensor(masks, dtype=torch.bool))
    cached.parent.mkdir(parents=True, exist_ok=True)
    save_safetensors(cached, {"input_ids": data.tokens, "supervised": data.supervised.to(torch.uint8)})
    return data


def load_target(path: str, device: torch.device, num_drafter_layers: int) -> Target:
    """Load a causal LM from a local folder onto ``device``, frozen, in bf16 on GPU."""
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=compute_dtype(device), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--target {path}: cannot load the model: {e}") from e
    model.to(device)
    return Target(model, tap_layer_ids(model.config.num_hidden_layers, num_drafter_layers))
