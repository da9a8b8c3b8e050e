"""The DFlash training loss: decayed cross-entropy over draft blocks, computed in checkpointed chunks.

Block position k (k >= 1) predicts token anchor + k with weight exp(-(k - 1) / gamma): early
positions matter most, because a draft is only accepted up to its first mistake. Position 0 is the
anchor itself (given, not predicted). Labels past the end of the sequence and padding blocks weigh 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[block_size]: 0 for the anchor, exp(-(k-1)/gamma) for k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), torch.zeros(()))


def block_targets(
    input_ids: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    block_size: int,
    gamma: float,
    supervised: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels [B, N, bs] (token anchor + k) and loss weights [B, N, bs]; a label that is not a ``supervised``
    token (the prompt, padding: [B, S], None for all supervised) weighs 0."""
    seq_len = input_ids.shape[1]
    idx = anchors.unsqueeze(-1) + torch.arange(block_size, device=anchors.device)  # [B, N, bs]
    in_range = idx < seq_len
    flat = idx.clamp(max=seq_len - 1).flatten(1)
    labels = torch.gather(input_ids, 1, flat).view_as(idx)
    counted = in_range & keep.unsqueeze(-1)
    if supervised is not None:
        counted &= torch.gather(supervised, 1, flat).view_as(idx)
    weights = position_weights(block_size, gamma).to(anchors.device) * counted
    return labels, weights


def _chunk_loss(
    hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = lm_head(hidden).float()
    ce = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none")
    with torch.no_grad():
        correct = ((logits.argmax(-1) == labels) & (weights > 0)).sum()
    return (ce * weights.flatten()).sum(), correct


def chunked_loss(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    labels: torch.Tensor,
    weights: torch.Tensor,
    chunk_blocks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted CE summed over all block positions, and the count of correct top-1 predictions.

    ``hidden`` is [B, N * bs, D]. Each chunk of ``chunk_blocks`` blocks computes its logits under
    non-reentrant checkpointing, so the [tokens, vocab] logits of a real vocabulary (150k) never
    exist for more than one chunk at a time, in the forward or the backward.
    """
    batch, num_blocks, block_size = labels.shape
    hidden = hidden.view(batch, num_blocks, block_size, -1)
    total = hidden.new_zeros((), dtype=torch.float32)
    correct = torch.zeros((), dtype=torch.long, device=hidden.device)
    for start in range(0, num_blocks, chunk_blocks):
        part = slice(start, start + chunk_blocks)
        loss, hits = checkpoint(
            _chunk_loss, hidden[:, part], lm_head, labels[:, part], weights[:, part], use_reentrant=False
        )
        total = total + loss
        correct = correct + hits
    return total, correct
