"""A target of realistic width for the trainer, built here: random weights, nothing downloaded.

    python -m bench.real_target OUT_DIR [--shape gpu|cpu] [--seed N]

Writes a Hugging Face folder (``save_pretrained``: config, bf16 weights, tokenizer) that
``python -m dflash_train --target OUT_DIR`` loads. ``gpu`` is Qwen3-shaped at 839 M parameters (hidden 2048,
16 layers, 16 heads, 8 KV heads, head_dim 128, intermediate 6144, vocab 8192): wide enough that the GPU, not
Python, bounds a training step, as with the models users train drafters for. ``cpu`` is the same shape
narrowed until a CPU step takes seconds. The tokenizer is a byte-level BPE trained with ``tokenizers`` on this
Python's standard library (the trainer's default text), with EOS and DFlash's mask token as special tokens,
so that the mask token has a row of the embedding. Random weights write random text; what a benchmark
measures here is speed and memory, not acceptance. An existing folder is kept (rebuilding takes a minute).
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

SHAPES = {
    "gpu": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                head_dim=128, intermediate_size=6144),
    "cpu": dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                head_dim=64, intermediate_size=768),
}  # fmt: skip
VOCAB = 8192
EOS, MASK = "<|endoftext|>", "<|MASK|>"


def _tokenizer(vocab_size: int):
    """A byte-level BPE of ``vocab_size`` ids, trained on the standard library's top-level modules."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from dflash_train.data import corpus_files

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, MASK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte has a token: no unknown input
    )
    files = [str(path) for path in corpus_files("stdlib")]
    bpe.train(files, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, mask_token=MASK, pad_token=EOS)


def build(out: Path, shape: str = "gpu", seed: int = 0) -> Path:
    """Write the target to ``out`` (atomically: a folder that exists is complete) unless it is there."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if (out / "config.json").is_file():
        return out
    tokenizer = _tokenizer(VOCAB)
    config = Qwen3Config(
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **SHAPES[shape],
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def cached(shape: str) -> Path:
    """The target of ``shape`` in the trainer's cache folder, built there the first time: the benchmarks share it."""
    return build(Path.home() / ".cache" / "dflash_train" / f"bench-target-{shape}", shape)


def parameters(shape: str) -> int:
    """The target's parameter count, from its shape alone."""
    s = SHAPES[shape]
    h, kv, hd = s["hidden_size"], s["num_key_value_heads"], s["head_dim"]
    attention = h * s["num_attention_heads"] * hd * 2 + h * kv * hd * 2 + 2 * hd
    layer = attention + 3 * h * s["intermediate_size"] + 2 * h
    return s["num_hidden_layers"] * layer + 2 * VOCAB * h + h


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.real_target", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = build(args.out, args.shape, args.seed)
    print(f"{path}: Qwen3, {parameters(args.shape) / 1e6:.0f} M parameters ({args.shape} shape)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
