"""Anchor sampling and the anchor block mask: the one attention rule of DFlash training.

Layout of one training forward (per sequence): keys/values are [context (S positions) ; block 0 ;
block 1 ; ...], queries are [block 0 ; block 1 ; ...]; each block is an anchor token followed by
mask tokens. The rule, as a flex-attention ``mask_mod``:

* a query in block j sees context positions strictly before its anchor (at inference the target's
  hidden state at the anchor does not exist yet: the anchor is the token the target just produced),
* it sees every position of its own block (bidirectional), and nothing of other blocks,
* a padding block (``keep`` false) sees nothing at all.

The same function builds the sparse ``BlockMask`` on CUDA and, evaluated on broadcast index
tensors, the dense boolean mask for SDPA on CPU, so the two paths cannot disagree.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sample_anchors(
    batch_size: int,
    seq_len: int,
    num_anchors: int,
    generator: torch.Generator,
    supervised: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors per sequence, uniformly without replacement among the positions that can anchor, sorted.

    A position p can anchor a block if it has context before it (p >= 1) and a label after it
    (p + 1 < seq_len), and, where ``supervised`` [B, S] says which tokens the target wrote, if p and p + 1
    are both such tokens. When a sequence has fewer such positions than ``num_anchors``, the rest are
    padding blocks: anchor 0, ``keep`` False. Returns ``anchors`` [B, N] (int64) and ``keep`` [B, N].
    """
    positions = torch.arange(seq_len)
    can = ((positions >= 1) & (positions + 1 < seq_len)).expand(batch_size, seq_len)
    if supervised is not None:
        can = can & supervised & torch.nn.functional.pad(supervised[:, 1:], (0, 1), value=False)
    # Random scores, positions that cannot anchor last; of the first k, those that can anchor, sorted, come first.
    k = min(num_anchors, seq_len)
    chosen = torch.rand(batch_size, seq_len, generator=generator).masked_fill(~can, 2.0).argsort(dim=1)[:, :k]
    chosen = torch.where(torch.gather(can, 1, chosen), chosen, seq_len).sort(dim=1).values
    anchors = torch.zeros(batch_size, num_anchors, dtype=torch.long)
    keep = torch.zeros(batch_size, num_anchors, dtype=torch.bool)
    keep[:, :k] = chosen < seq_len
    anchors[:, :k] = chosen.masked_fill(~keep[:, :k], 0)
    return anchors, keep


def anchor_block_mask_mod(anchors: torch.Tensor, keep: torch.Tensor, ctx_len: int, block_size: int) -> MaskMod:
    """The rule above as ``mask_mod(b, h, q_idx, kv_idx) -> bool``.

    Works on scalars (flex attention vmaps it) and on broadcast index tensors (``dense_mask``).
    ``create_block_mask`` pads the query length up to a multiple of its block size (128), so
    ``q_idx`` may point past the last block: the block index is clamped for the lookups and such
    queries see nothing.
    """
    num_blocks = anchors.shape[1]

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        q_block = q_idx // block_size
        safe_block = q_block.clamp(max=num_blocks - 1)
        in_context = (kv_idx < ctx_len) & (kv_idx < anchors[b, safe_block])
        in_own_block = (kv_idx >= ctx_len) & ((kv_idx - ctx_len) // block_size == q_block)
        return (in_context | in_own_block) & keep[b, safe_block] & (q_block < num_blocks)

    return mask_mod


def dense_mask(mask_mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Evaluate ``mask_mod`` on every (b, q, kv): a [B, 1, Q, KV] boolean mask for SDPA."""
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(q_len, device=device).view(1, 1, -1, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, 1, -1)
    return mask_mod(b, h, q, kv).expand(batch, 1, q_len, kv_len)


# Compiled (rather than the deprecated ``_compile=True``) so the [B, Q, KV] intermediate is never
# materialised. One compiled function shared by every thread: compiling it concurrently from several
# threads is exactly what ``import torchfix`` makes safe.
compiled_create_block_mask = torch.compile(create_block_mask)


def build_mask(
    anchors: torch.Tensor, keep: torch.Tensor, ctx_len: int, block_size: int, *, flex: bool
) -> torch.Tensor | BlockMask:
    """The anchor block mask for ``anchors``/``keep`` (on the compute device) as BlockMask or dense."""
    batch, num_blocks = anchors.shape
    q_len, kv_len = num_blocks * block_size, ctx_len + num_blocks * block_size
    mask_mod = anchor_block_mask_mod(anchors, keep, ctx_len, block_size)
    if flex:
        return compiled_create_block_mask(mask_mod, B=batch, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=anchors.device)
    return dense_mask(mask_mod, batch, q_len, kv_len, anchors.device)


# The BlockMask tensors: the kv ones drive the forward kernel, the q ones (the transposed mask) only
# the backward one.
_BLOCK_MASK_TENSORS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


class StaticInputs:
    """What a replica's CUDA-graphed training step reads, at the same addresses every step.

    A CUDA graph tree takes every tensor saved for a compiled backward as a fixed address. A step's own
    inputs that the backward needs (the target's features for ``fc``'s gradient, the labels and weights of
    the loss, the q half of the block mask, which only flex attention's backward reads) reach the backward
    graph as the caller's tensors, not as copies the forward graph made; new tensors every step made the
    tree re-record the backward at every step (measured on an H200, torch 2.11: 2 recordings per step, the
    tree growing until ``cudagraph_unexpected_rerecord_limit``). Here each input is copied into a tensor
    allocated once per name and shape, and the block mask is rebuilt into the same tensors.
    """

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        self._mask: BlockMask | None = None
        self._mask_shape: tuple | None = None  # what the static mask was built for

    def tensor(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """``value``'s contents in the static tensor ``name`` (a new one when the shape, dtype or device differ)."""
        mine = self._tensors.get(name)
        if mine is None or (mine.shape, mine.dtype, mine.device) != (value.shape, value.dtype, value.device):
            mine = self._tensors[name] = value.clone(memory_format=torch.contiguous_format)
            return mine
        return mine.copy_(value)

    def mask(self, anchors: torch.Tensor, keep: torch.Tensor, ctx_len: int, block_size: int) -> BlockMask:
        """The step's anchor block mask, in the tensors of the last step's when the shapes are the same."""
        anchors, keep = self.tensor("mask.anchors", anchors), self.tensor("mask.keep", keep)
        # Evaluated over the static anchors, so the static mask's mask_mod (which reads them) agrees.
        fresh = build_mask(anchors, keep, ctx_len, block_size, flex=True)
        shape = (tuple(anchors.shape), anchors.device, ctx_len, block_size)
        if shape != self._mask_shape or self._mask is None:
            self._mask, self._mask_shape = fresh, shape
        else:
            for name in _BLOCK_MASK_TENSORS:
                mine = getattr(self._mask, name)
                if mine is not None:
                    mine.copy_(getattr(fresh, name))
        return self._mask
