"""The DFlash drafter: a few Qwen3-style decoder layers that draft a whole block at once.

The tapped target hidden states are concatenated, projected (``fc``) and RMS-normed into one
context feature per position. Every drafter layer takes its keys/values from
[context feature ; block tokens] and its queries from the block tokens only (K/V injection), so
every layer sees the target's view of the prefix. Block tokens are the anchor followed by mask
tokens; the embedding and the LM head are the target's, frozen and shared, not part of the drafter's
parameters (nor its checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint
from transformers import PretrainedConfig, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from .loss import chunked_loss
from .masks import StaticInputs, build_mask

if TYPE_CHECKING:
    from .batch import StepBatch

# flex_attention is only fast compiled (eager, it runs a slow reference implementation). One compiled
# function shared by all drafter threads, which compile it concurrently: ``import torchfix`` makes that safe.
compiled_flex_attention = torch.compile(flex_attention)


def drafter_config(
    target_config: PretrainedConfig, num_layers: int, block_size: int, tap_ids: list[int], mask_token_id: int
) -> Qwen3Config:
    """A Qwen3 config of the target's width and ``num_layers`` layers, plus the DFlash fields."""
    t = target_config
    heads = t.num_attention_heads
    cfg = Qwen3Config(
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(t, "num_key_value_heads", None) or heads,
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // heads,
        rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6),
        max_position_embeddings=t.max_position_embeddings,
        rope_parameters=getattr(t, "rope_parameters", None),
        tie_word_embeddings=False,
    )
    # What DFlash inference code (z-lab/dflash, which SGLang and vLLM follow) reads, where it reads it.
    cfg.architectures = ["DFlashDraftModel"]
    cfg.block_size, cfg.num_target_layers = block_size, t.num_hidden_layers
    cfg.dflash_config = {"block_size": block_size, "target_layer_ids": list(tap_ids), "mask_token_id": mask_token_id}
    return cfg


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask) -> torch.Tensor:
    """Attention under the anchor block mask: compiled flex attention for a BlockMask (CUDA), SDPA for a
    dense boolean mask (CPU, where flex attention has no backward)."""
    # Under bf16 autocast the RMS norms and rotary leave q and k in fp32 while v is bf16.
    q, k = q.to(v.dtype), k.to(v.dtype)
    if isinstance(mask, BlockMask):
        return compiled_flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class DFlashLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=eps)
        self.input_layernorm = Qwen3RMSNorm(d, eps=eps)
        self.post_attention_layernorm = Qwen3RMSNorm(d, eps=eps)
        self.mlp = Qwen3MLP(cfg)

    def forward(
        self,
        hidden: torch.Tensor,
        context: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | BlockMask,
    ) -> torch.Tensor:
        """``hidden`` [B, Q, D] block tokens; ``context`` [B, S, D]; ``cos``/``sin`` [B, S + Q, head_dim]."""
        batch, q_len, _ = hidden.shape
        x = self.input_layernorm(hidden)
        kv_in = torch.cat([context, x], dim=1)  # K/V injection: the context joins the keys and values
        q = self.q_norm(self.q_proj(x).view(batch, q_len, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(batch, -1, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(batch, -1, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos[:, :, -q_len:] + rotate_half(q) * sin[:, :, -q_len:]
        k = k * cos + rotate_half(k) * sin
        out = attend(q, k, v, mask).transpose(1, 2).reshape(batch, q_len, -1)
        hidden = hidden + self.o_proj(out)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Drafter(nn.Module):
    def __init__(self, cfg: Qwen3Config, embed: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.config = cfg
        dflash = cfg.dflash_config
        self.block_size = dflash["block_size"]
        self.mask_token_id = dflash["mask_token_id"]
        n_taps = len(dflash["target_layer_ids"])
        self.fc = nn.Linear(n_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(cfg)
        # Frozen and shared with the target (and every replica on the same device): kept in a tuple so
        # they are not registered, hence not in parameters(), state_dict() or the optimizer.
        self.frozen = (embed, lm_head)
        # What training calls per layer, gradient checkpointing included, and for the whole step's loss: see
        # compile_training.
        self.train_layer_fns: list[Callable[..., torch.Tensor]] = [checkpointed(layer) for layer in self.layers]
        self.compute_loss: Callable[..., tuple[torch.Tensor, torch.Tensor]] = self.loss_terms
        # Set when the step replays CUDA graphs, which read their inputs at the same addresses every step.
        self.static_inputs: StaticInputs | None = None
        self._init_weights(cfg.initializer_range)

    def _init_weights(self, std: float) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)

    def compile_training(self, backend: str, mode: str | None = None) -> None:
        """Compile what a training step runs. Evaluation keeps the eager layers: its shapes change at every step.

        ``mode`` None (the CPU path: dense mask + SDPA in the graph): each layer, under the checkpoint, as the
        eager one runs. A ``mode`` (``--compile-mode``, the CUDA path: flex attention in the graph): the whole
        loss of the step (``loss_terms``: block inputs, ``fc``, every layer with its checkpoint, the chunked
        loss), so that a step is one forward and one backward graph, CUDA graphs with ``reduce-overhead``, not
        dozens of small eager kernels launched under the GIL between them. Traced by Dynamo, the
        checkpoints' recompute is part of the compiled backward (outside, the backward would replay the
        compiled forward on autograd's device thread, which CUDA graph trees handle badly). With
        ``reduce-overhead`` the step's inputs are copied into static tensors (``StaticInputs``)."""
        if mode is None:
            self.train_layer_fns = [checkpointed(torch.compile(layer, backend=backend)) for layer in self.layers]
            return
        self.train_layer_fns = [checkpointed(layer) for layer in self.layers]
        self.compute_loss = torch.compile(self.loss_terms, backend=backend, mode=mode)
        if mode == "reduce-overhead":
            self.static_inputs = StaticInputs()

    @property
    def embed(self) -> nn.Module:
        return self.frozen[0]

    @property
    def lm_head(self) -> nn.Module:
        return self.frozen[1]

    def forward(
        self,
        features: torch.Tensor,
        block_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | BlockMask,
    ) -> torch.Tensor:
        """Hidden states of all block positions.

        ``features`` [B, S, k * D] tapped target states of the context; ``block_ids`` [B, N * bs];
        ``position_ids`` [B, S + N * bs] (context, then each block at anchor + k). In training mode the
        layers run (compiled, if asked) under non-reentrant gradient checkpointing.
        """
        context = self.hidden_norm(self.fc(features))
        hidden = self.embed(block_ids)
        cos, sin = self.rotary(hidden, position_ids)
        for layer, train_fn in zip(self.layers, self.train_layer_fns):
            if self.training:
                hidden = train_fn(hidden, context, cos, sin, mask)
            else:
                hidden = layer(hidden, context, cos, sin, mask)
        return self.norm(hidden)

    def block_inputs(
        self, anchor_tokens: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor, ctx_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block token ids [B, N * bs] (anchor token, then mask tokens; padding blocks are all mask
        tokens) and position ids [B, S + N * bs] (context 0..S-1, then anchor + k for each block)."""
        batch, num_blocks = anchors.shape
        device = anchors.device
        blocks = torch.full((batch, num_blocks, self.block_size), self.mask_token_id, dtype=torch.long, device=device)
        blocks[:, :, 0] = torch.where(keep, anchor_tokens, self.mask_token_id)
        block_pos = (anchors.unsqueeze(-1) + torch.arange(self.block_size, device=device)).flatten(1)
        ctx_pos = torch.arange(ctx_len, device=device).expand(batch, -1)
        return blocks.flatten(1), torch.cat([ctx_pos, block_pos], dim=1)

    def training_loss(self, batch: StepBatch, *, flex: bool, chunk_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This replica's share of the step loss (weighted CE sum / ``batch.loss_norm``) and its count
        of correct top-1 predictions, under the anchor block mask (flex ``BlockMask`` or dense)."""
        ctx_len = batch.input_ids.shape[1]
        inputs = {
            "features": batch.features,
            "input_ids": batch.input_ids,
            "anchors": batch.anchors,
            "keep": batch.keep,
            "labels": batch.labels,
            "weights": batch.weights,
        }
        if flex and self.static_inputs is not None:
            mask = self.static_inputs.mask(batch.anchors, batch.keep, ctx_len, self.block_size)
            inputs = {name: self.static_inputs.tensor(name, value) for name, value in inputs.items()}
        else:
            mask = build_mask(batch.anchors, batch.keep, ctx_len, self.block_size, flex=flex)
        total, correct = self.compute_loss(**inputs, mask=mask, chunk_blocks=chunk_blocks)
        return total / batch.loss_norm, correct

    def loss_terms(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        anchors: torch.Tensor,
        keep: torch.Tensor,
        labels: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor | BlockMask,
        chunk_blocks: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The weighted CE sum and the correct top-1 count of a training forward (see ``training_loss``)."""
        anchor_tokens = torch.gather(input_ids, 1, anchors)
        block_ids, position_ids = self.block_inputs(anchor_tokens, anchors, keep, input_ids.shape[1])
        with autocast(input_ids.device):
            hidden = self(features, block_ids, position_ids, mask)
            return chunked_loss(hidden, self.lm_head, labels, weights, chunk_blocks)

    def draft(self, features: torch.Tensor, anchor_token: int) -> list[int]:
        """Greedy draft of the ``bs - 1`` tokens after ``anchor_token``, the token right after the
        context whose tapped target states are ``features`` [1, S, k * D]. Call in eval mode."""
        return self.draft_logits(features, anchor_token).argmax(-1)[0].tolist()

    @torch.no_grad()
    def draft_logits(self, features: torch.Tensor, anchor_token: int) -> torch.Tensor:
        """The logits [1, bs - 1, vocab] :meth:`draft` takes its tokens from."""
        device = self.fc.weight.device
        features = features.to(device)
        ctx_len = features.shape[1]
        anchors = torch.tensor([[ctx_len]], device=device)
        keep = torch.ones(1, 1, dtype=torch.bool, device=device)
        block_ids, position_ids = self.block_inputs(
            torch.tensor([[anchor_token]], device=device), anchors, keep, ctx_len
        )
        mask = build_mask(anchors, keep, ctx_len, self.block_size, flex=False)
        with autocast(device):
            hidden = self(features, block_ids, position_ids, mask)
            return self.lm_head(hidden[:, 1:]).float()


def checkpointed(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A layer's training call: ``fn`` under non-reentrant gradient checkpointing (its activations are
    recomputed in the backward). ``.checkpointed`` is ``fn``."""

    def train_call(
        hidden: torch.Tensor,
        context: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | BlockMask,
    ) -> torch.Tensor:
        return checkpoint(fn, hidden, context, cos, sin, mask, use_reentrant=False)

    train_call.checkpointed = fn  # type: ignore[attr-defined]
    return train_call


def autocast(device: torch.device):
    """bf16 autocast on GPU; a no-op on CPU (fp32)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def make_replicas(
    cfg: Qwen3Config, heads: dict[torch.device, tuple[nn.Module, nn.Module]], devices: list[torch.device], seed: int
) -> list[Drafter]:
    """One drafter per entry of ``devices`` (a device may repeat), all with replica 0's initial weights.

    ``heads[device]`` is the frozen (embedding, LM head) pair on that device: replicas on one device
    share it."""
    torch.manual_seed(seed)
    replicas = [Drafter(cfg, *heads[devices[0]])]
    for device in devices[1:]:
        replica = Drafter(cfg, *heads[device])
        replica.load_state_dict(replicas[0].state_dict())
        replicas.append(replica)
    return [r.to(d) for r, d in zip(replicas, devices)]
