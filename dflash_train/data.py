"""Tokenizers and training text: a byte-level tokenizer built in code, an adapter for a local Hugging
Face tokenizer, the corpus (Python's own standard library by default), and deterministic batches.

Every batch is a pure function of (seed, step): a resumed run sees exactly the batches the
uninterrupted run would have seen, whichever target thread produced them.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from .config import ConfigError


class Tokenizer(Protocol):
    vocab_size: int
    mask_token_id: int
    eos_token_id: int
    pad_token_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    # A prompt as the target is asked it: wrapped in the tokenizer's chat template where it has one.
    def prompt(self, ids: list[int]) -> list[int]: ...

    # What ``prompt`` depends on besides the ids (the chat template), for cache keys.
    def prompt_format(self) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are tokens 0-255; then a few special tokens, including DFlash's mask token."""

    PAD, EOS, MASK = 256, 257, 258
    vocab_size = 264  # 259 rounded up to a multiple of 8
    mask_token_id = MASK
    eos_token_id = EOS
    pad_token_id = PAD

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def prompt(self, ids: list[int]) -> list[int]:
        return ids  # no chat template

    def prompt_format(self) -> str:
        return ""


class HFTokenizer:
    """A local Hugging Face tokenizer, with a mask token that fits the target's embedding."""

    def __init__(self, path: str, embedding_rows: int):
        from transformers import AutoTokenizer

        try:
            self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--target {path}: cannot load its tokenizer: {e}") from e
        if self.tok.mask_token_id is None:
            # DFlash adds "<|MASK|>"; it must land on an existing (padding) row of the frozen embedding.
            self.tok.add_special_tokens({"mask_token": "<|MASK|>"})
        if self.tok.mask_token_id >= embedding_rows:
            raise ConfigError(
                f"{path}: the tokenizer has no mask token and adding one (id {self.tok.mask_token_id}) "
                f"would not fit the target's {embedding_rows} embedding rows"
            )
        self.vocab_size = embedding_rows
        self.mask_token_id = int(self.tok.mask_token_id)
        eos = self.tok.eos_token_id
        self.eos_token_id = int(eos if eos is not None else self.mask_token_id)
        pad = self.tok.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.eos_token_id)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def prompt(self, ids: list[int]) -> list[int]:
        """The text of ``ids`` as a user's message, in the chat template (with the assistant's turn opened)."""
        if not self.tok.chat_template:
            return ids
        messages = [{"role": "user", "content": self.decode(ids)}]
        return list(
            self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )

    def prompt_format(self) -> str:
        return self.tok.chat_template or ""


def corpus_files(spec: str) -> list[Path]:
    """'stdlib' -> the top-level modules of this Python's standard library; else a file or directory."""
    if spec == "stdlib":
        files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    else:
        p = Path(spec)
        if not p.exists():
            raise ConfigError(f"--data: {spec} does not exist")
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    if not files:
        raise ConfigError(f"--data: no text files found in {spec}")
    return files


@dataclass
class Corpus:
    """Token ids of the training and held-out documents, each document followed by EOS."""

    train: torch.Tensor  # 1-D int64
    held_out: torch.Tensor

    @classmethod
    def load(cls, spec: str, tokenizer: Tokenizer, max_bytes: int = 16 << 20) -> Corpus:
        files = corpus_files(spec)
        # Every 10th document is held out for the acceptance-length evaluation.
        train_ids: list[int] = []
        held_ids: list[int] = []
        total = 0
        for i, f in enumerate(files):
            text = f.read_text(encoding="utf-8", errors="replace")
            total += len(text)
            held = i % 10 == 0 and len(files) > 1
            (held_ids if held else train_ids).extend(tokenizer.encode(text) + [tokenizer.eos_token_id])
            if total >= max_bytes:
                break
        train, held = torch.tensor(train_ids, dtype=torch.long), torch.tensor(held_ids, dtype=torch.long)
        if len(held) == 0:  # a single file: hold out its tail
            cut = int(len(train) * 0.9)
            train, held = train[:cut], train[cut:]
        return cls(train, held)


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """An RNG that depends only on (seed, step, stream): data and anchors reproduce on resume."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 31 + stream)


def batch_for_step(tokens: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    """``batch_size`` random windows of ``seq_len`` tokens from the training stream: [B, S]."""
    if len(tokens) <= seq_len:
        raise ConfigError(f"the training text has {len(tokens)} tokens, fewer than --seq-len {seq_len}")
    starts = torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=step_generator(seed, step))
    return torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])


@dataclass
class TrainingData:
    """What the drafter trains on: the text as one token stream, cut into random windows, every token
    supervised; or regenerated samples, one per training sequence, ``supervised`` where the target wrote
    (not the prompt, not the padding after its EOS)."""

    tokens: torch.Tensor  # [T] (the text) or [N, S] (samples)
    supervised: torch.Tensor | None = None  # [N, S] bool, with samples

    def batch(self, step: int, batch_size: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's sequences [B, S] and which of their tokens are supervised (None: all)."""
        if self.supervised is None:
            return batch_for_step(self.tokens, step, batch_size, seq_len, seed), None
        if self.tokens.shape[1] != seq_len:
            raise ConfigError(f"the regenerated samples have {self.tokens.shape[1]} tokens, not --seq-len {seq_len}")
        rows = torch.randint(0, len(self.tokens), (batch_size,), generator=step_generator(seed, step))
        return self.tokens[rows], self.supervised[rows]


def eval_prompts(held_out: torch.Tensor, count: int, length: int) -> list[torch.Tensor]:
    """``count`` prompts of ``length`` tokens, evenly spaced through the held-out text."""
    span = len(held_out) - length
    if span <= 0:
        raise ConfigError(f"the held-out text has {len(held_out)} tokens, too few for --eval-prompt-len {length}")
    return [held_out[i * span // count : i * span // count + length] for i in range(count)]
