"""Model FLOPs of one training step, and the peak they are compared with: MFU.

The count is of the matrix multiplications the step's math needs (2 FLOPs per multiply-add), whatever the
kernels do; elementwise work, norms and softmax are left out. With T = B·S context tokens of a step and
Q = B·N·bs block tokens (N anchors of bs tokens per sequence):

* target, forward only (frozen), up to its last tapped layer (the later layers and the LM head do not run):
  2·T·P + 2·T·S·d_attn per layer, where P is a decoder layer's weights and the causal attention's QKᵀ and AV
  cost 2·S·d_attn per token on average;
* drafter forward: ``fc`` 2·T·(k·D)·D; per layer q and o over Q tokens, k and v over the T + Q tokens
  they are computed for (K/V injection), the MLP over Q, attention 4·Q·(S/2 + bs)·d_attn (a block sees the
  context up to its anchor, S/2 on average, and its own bs tokens); the LM head 2·Q·D·V in the loss;
* drafter training: its layers 4 × their forward (the forward, its recompute in the backward under gradient
  checkpointing, a backward of twice the forward); ``fc`` 2 × (its input, the target's features, needs no
  gradient); the LM head 3 × (forward, recompute of the checkpointed loss, the gradient of its input: its
  weight is the target's, frozen).

MFU = those FLOPs per second / the peak dense bf16 tensor-core FLOP/s of the job's GPUs (NVIDIA's data
sheets: H100 and H200 SXM 989.4 TFLOP/s, A100 312); None on CPUs and on GPUs not in the table.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

# Dense bf16 tensor-core peak FLOP/s by the name CUDA reports (the first match wins).
PEAK_BF16 = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}


def _attention_width(config: PretrainedConfig) -> tuple[int, int, int]:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads * head_dim, kv_heads * head_dim, heads * head_dim  # q / o width, k / v width, QKᵀ width


def step_flops(
    target: PretrainedConfig,
    drafter: PretrainedConfig,
    *,
    batch_size: int,
    seq_len: int,
    num_anchors: int,
    block_size: int,
) -> float:
    """The model FLOPs of one optimizer step of the whole job (its global batch), as the module says."""
    tokens, blocks = batch_size * seq_len, batch_size * num_anchors * block_size
    d, q_width, kv_width, attn = target.hidden_size, *_attention_width(target)
    per_layer = 2 * d * q_width + 2 * d * kv_width + 3 * d * target.intermediate_size  # q, o; k, v; MLP
    tap_ids = drafter.dflash_config["target_layer_ids"]
    target_forward = (max(tap_ids) + 1) * (2 * tokens * per_layer + 2 * tokens * seq_len * attn)

    d, q_width, kv_width, attn = drafter.hidden_size, *_attention_width(drafter)
    taps = len(tap_ids)
    layer = (
        2 * blocks * 2 * d * q_width  # q and o projections of the block tokens
        + 2 * (tokens + blocks) * 2 * d * kv_width  # k and v of context and block tokens
        + 2 * blocks * 3 * d * drafter.intermediate_size  # the MLP
        + 4 * blocks * (seq_len / 2 + block_size) * attn  # attention
    )
    fc, lm_head = 2 * tokens * taps * d * d, 2 * blocks * d * drafter.vocab_size
    return target_forward + 2 * fc + 4 * drafter.num_hidden_layers * layer + 3 * lm_head


def peak_flops(devices: list[torch.device]) -> float | None:
    """The summed bf16 peak of the distinct CUDA devices in ``devices``; None if any is a CPU or unknown."""
    distinct = set(devices)
    if not distinct or any(d.type != "cuda" for d in distinct):
        return None
    total = 0.0
    for device in distinct:
        name = torch.cuda.get_device_name(device)
        peak = next((flops for key, flops in PEAK_BF16.items() if key in name), None)
        if peak is None:
            return None
        total += peak
    return total
