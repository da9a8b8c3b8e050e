"""What one optimizer step trains on, and how it is split across the drafter replicas."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .data import TrainingData, step_generator
from .loss import block_targets
from .masks import sample_anchors


@dataclass
class StepBatch:
    step: int
    input_ids: torch.Tensor  # [B, S]
    anchors: torch.Tensor  # [B, N]
    keep: torch.Tensor  # [B, N], False for padding blocks
    labels: torch.Tensor  # [B, N, bs]
    weights: torch.Tensor  # [B, N, bs]
    # Divides the replica's weighted loss sum: the step's total weight / number of shards, so that the
    # *average* of the replicas' gradients is the gradient of the step's weighted mean loss, however
    # unevenly the valid blocks fall across shards.
    loss_norm: float
    # Labels with a weight above 0, counted on the host where the batch is made: counted on the device, each
    # drafter step would wait for the GPU to read the number.
    supervised: int
    features: torch.Tensor | None = None  # [B, S, k * D], filled in by a target worker
    # Recorded on the target thread's stream once the shard's tensors are made (see streams.py).
    ready: torch.cuda.Event | None = None

    def split(self, n: int) -> list[StepBatch]:
        """``n`` shards along the batch dimension (the batch size is a multiple of ``n``)."""
        fields = ("input_ids", "anchors", "keep", "labels", "weights", "features")
        parts = {f: getattr(self, f).chunk(n) if getattr(self, f) is not None else [None] * n for f in fields}
        return [
            dataclasses.replace(
                self,
                loss_norm=self.loss_norm / n,
                supervised=int((parts["weights"][i] > 0).sum()),
                **{f: parts[f][i] for f in fields},
            )
            for i in range(n)
        ]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: v for f in dataclasses.fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)}

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def to(self, device: torch.device) -> StepBatch:
        return dataclasses.replace(self, **{name: to_device(t, device) for name, t in self.tensors().items()})


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``, without making the calling thread wait for the GPU. A blocking copy from
    pageable host memory waits for everything queued on the thread's stream (on a shared stream, for every
    thread's work); from pinned memory the copy is queued, and the pinned block is kept until it is done."""
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def make_step_batch(
    data: TrainingData,
    step: int,
    *,
    batch_size: int,
    seq_len: int,
    num_anchors: int,
    block_size: int,
    gamma: float,
    seed: int,
) -> StepBatch:
    """The step's sequences and freshly sampled anchors: a pure function of (seed, step)."""
    input_ids, supervised = data.batch(step, batch_size, seq_len, seed)
    generator = step_generator(seed, step, stream=1)
    anchors, keep = sample_anchors(batch_size, seq_len, num_anchors, generator, supervised)
    labels, weights = block_targets(input_ids, anchors, keep, block_size, gamma, supervised)
    # At least 1: a batch with nothing supervised (every sample ended at once) has a loss of 0, not 0 / 0.
    norm, counted = max(1.0, float(weights.sum())), int((weights > 0).sum())
    return StepBatch(step, input_ids, anchors, keep, labels, weights, loss_norm=norm, supervised=counted)
