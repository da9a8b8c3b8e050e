"""An exported drafter in the reference DFlash client: z-lab's ``dflash`` package (``DFlashDraftModel``, which
SGLang and vLLM follow), installed without its pinned extras (``nox -s dflash_client``); skipped where it is
absent. Loaded from the exported folder alone, it must generate the target's greedy text with the same
acceptance lengths as dflash_train's own speculative decoding."""

from __future__ import annotations

import time

import pytest
import torch
from safetensors import safe_open

dflash_model = pytest.importorskip("dflash.model", reason="z-lab's dflash package is not installed")

from dflash_train.config import TrainConfig  # noqa: E402
from dflash_train.evaluate import speculative_generate  # noqa: E402
from dflash_train.target import load_target  # noqa: E402
from dflash_train.train import train  # noqa: E402


def test_the_reference_client_generates_the_targets_text_with_our_acceptance_lengths(tmp_path, monkeypatch):
    # Its timer synchronises CUDA, which a CPU-only torch cannot: timing only, so a plain clock here.
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)
    cfg = TrainConfig(
        tiny_target_steps=40,  # a target with some greedy structure, so that drafts are partly accepted
        regenerate=0,
        cache_dir=str(tmp_path / "cache"),
        out_dir=str(tmp_path / "run"),
        seq_len=48,
        batch_size=4,
        num_anchors=6,
        steps=30,
        compile=False,
        eval_prompts=0,
        progress=False,
        watchdog_timeout=0,
        export=str(tmp_path / "export"),
    )
    drafter = train(cfg).drafters[0].eval()
    # The export names the target; the run's checkpoint knows where this machine keeps it.
    with safe_open(str(tmp_path / "run" / "checkpoint.safetensors"), framework="pt") as f:
        target_path = f.metadata()["target_path"]
    target = load_target(target_path, torch.device("cpu"), cfg.drafter_layers)

    client = dflash_model.DFlashDraftModel.from_pretrained(cfg.export, dtype=torch.float32).eval()
    assert client.block_size == drafter.block_size and client.target_layer_ids == target.tap_ids
    generator, accepted = torch.Generator().manual_seed(0), []
    for _ in range(3):
        prompt = torch.randint(0, 256, (1, 20), generator=generator)
        ours = speculative_generate(target, drafter.draft, prompt[0].tolist(), 32)
        theirs = dflash_model.dflash_generate(
            client, target.model, prompt, max_new_tokens=32, stop_token_ids=None, return_stats=True
        )
        greedy = target.model.generate(prompt, max_new_tokens=32, do_sample=False)[0].tolist()
        assert theirs.output_ids[0].tolist() == greedy == ours.tokens
        assert theirs.acceptance_lengths == ours.accepted
        accepted += ours.accepted
    assert max(accepted) > 1, f"no draft token was accepted: {accepted}"  # else the drafts were never compared
