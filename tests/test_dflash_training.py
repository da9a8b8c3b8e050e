"""dflash_train's threaded training loop, in-process with tiny sizes and nothing compiled:
replicas stay identical, data parallelism is exact, resume is exact, bad checkpoints are refused."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dflash_train.config import ConfigError, TrainConfig
from dflash_train.train import TrainResult, train
from dflash_train.workers import WorkerFailed


def tiny_config(tmp_path_factory) -> TrainConfig:
    """A few-second run: untrained tiny target, short sequences, eager layers, no evaluation."""
    return TrainConfig(
        tiny_target_steps=0,
        regenerate=0,
        cache_dir=str(tmp_path_factory.getbasetemp() / "cache"),
        out_dir=str(tmp_path_factory.mktemp("run")),
        seq_len=48,
        batch_size=4,
        num_anchors=6,
        loss_chunk=4,
        steps=5,
        warmup_steps=2,
        lr=3e-3,
        compile=False,
        eval_prompts=0,
        progress=False,
        watchdog_timeout=0,
    )


@pytest.fixture
def tiny(tmp_path_factory) -> TrainConfig:
    return tiny_config(tmp_path_factory)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> TrainResult:
    """The tiny run, uninterrupted (2 drafter threads): trained once for the tests that only read it."""
    return train(tiny_config(tmp_path_factory))


def weights(drafter) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in drafter.state_dict().items()}


def test_replicas_stay_identical(tiny):
    cfg = dataclasses.replace(tiny, drafter_threads_per_device=4)
    result = train(cfg)
    assert result.steps_done == cfg.steps and len(result.drafters) == 4
    first = weights(result.drafters[0])
    one_step = weights(train(dataclasses.replace(cfg, steps=1, out_dir=cfg.out_dir + "-1")).drafters[0])
    assert any(not torch.equal(first[k], one_step[k]) for k in first), "the weights moved"
    for replica in result.drafters[1:]:
        for name, value in weights(replica).items():
            assert torch.equal(value, first[name]), f"replicas differ in {name}"


def test_two_threads_on_half_batches_match_one_thread(tiny, straight):
    one = train(dataclasses.replace(tiny, drafter_threads_per_device=1, out_dir=tiny.out_dir + "-one"))
    two = straight
    assert len(two.drafters) == 2
    assert one.final_loss == pytest.approx(two.final_loss, rel=1e-4)
    a, b = weights(one.drafters[0]), weights(two.drafters[0])
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=2e-4, rtol=1e-3, msg=f"{name} differs")


def test_resume_continues_exactly(tiny, straight):
    cut = dataclasses.replace(tiny, out_dir=tiny.out_dir + "-cut", stop_after=2)
    assert train(cut).steps_done == 2
    resumed = train(dataclasses.replace(cut, stop_after=0, resume=True))
    assert resumed.steps_done == tiny.steps
    a = load_file(straight.out_dir / "checkpoint.safetensors")
    b = load_file(cut.out_dir + "/checkpoint.safetensors")
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    for name in a:  # weights and optimizer state, bit for bit
        assert torch.equal(a[name], b[name]), name


def test_bad_checkpoints_are_refused_with_one_message(tiny):
    with pytest.raises(ConfigError, match="no checkpoint"):
        train(dataclasses.replace(tiny, resume=True))
    train(dataclasses.replace(tiny, steps=1))
    with pytest.raises(ConfigError, match="incompatible.*--block-size 8.*--block-size 4"):
        train(dataclasses.replace(tiny, block_size=4, resume=True))
    with pytest.raises(ConfigError, match="incompatible.*--drafter-layers"):
        train(dataclasses.replace(tiny, drafter_layers=1, resume=True))
    path = tiny.out_dir + "/checkpoint.safetensors"
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])  # a save cut short
    with pytest.raises(ConfigError, match="corrupt"):
        train(dataclasses.replace(tiny, resume=True))
    open(path, "wb").write(b"\x00" * 64)
    with pytest.raises(ConfigError, match="corrupt"):
        train(dataclasses.replace(tiny, resume=True))


def test_local_hugging_face_model_and_tokenizer(tiny, tmp_path):
    """--target PATH: a causal LM and its own (non-byte) tokenizer from a local folder; block 16."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)))
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train(
        [str(text)], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>", "<|user|>", "<|bot|>"])
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="<eos>")
    tokenizer.chat_template = "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}<|bot|>"
    model_dir = tmp_path / "model"
    tokenizer.save_pretrained(model_dir)
    config = Qwen3Config(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=5,  # a 2-layer drafter taps layers 1 and 2 (of 1 to L-3)
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )
    Qwen3ForCausalLM(config).save_pretrained(model_dir)

    cfg = dataclasses.replace(
        tiny,
        target=str(model_dir),
        data=str(text),
        steps=2,
        regenerate=4,
        eval_prompts=1,
        eval_prompt_len=16,
        eval_new_tokens=8,
    )
    result = train(cfg)
    assert result.steps_done == 2 and result.drafters[0].block_size == 16
    assert result.drafters[0].mask_token_id == tokenizer.vocab_size  # "<|MASK|>" added, within 320 rows
    assert 1.0 <= result.tau_after <= 16
    # The target was asked in its chat template: each sample opens a user turn and the bot's, unsupervised.
    (cached,) = Path(cfg.cache_dir).glob("regenerated-*.safetensors")
    samples = load_file(str(cached))
    user, bot = tokenizer.convert_tokens_to_ids(["<|user|>", "<|bot|>"])
    for row, supervised in zip(samples["input_ids"].tolist(), samples["supervised"].bool().tolist()):
        assert row[0] == user and bot in row and not any(supervised[: row.index(bot) + 1])
        assert supervised[row.index(bot) + 1]  # the target's first token


def test_regenerated_samples_supervise_only_what_the_target_wrote(tiny):
    """One sample per row: an unsupervised prompt, the target's greedy continuation up to and with its own
    EOS, unsupervised padding; anchors and labels only where the target wrote."""
    from dflash_train.batch import make_step_batch
    from dflash_train.data import ByteTokenizer
    from dflash_train.target import load_target, prepare_target, regenerate

    cfg = dataclasses.replace(tiny.resolved(), regenerate=6)
    cpu = torch.device("cpu")
    path, _, corpus = prepare_target(cfg, cpu)
    target = load_target(path, cpu, cfg.drafter_layers)
    prompt_len = cfg.seq_len // 4
    # Samples end where the target writes its EOS: make that a token it writes early in the first sample.
    first = regenerate(cfg, target, path, corpus, ByteTokenizer()).tokens[0]
    frequent = int(first[prompt_len + 3])

    class EndsAtFrequent(ByteTokenizer):
        eos_token_id = frequent

    data = regenerate(cfg, target, path, corpus, EndsAtFrequent())
    assert data.tokens.shape == data.supervised.shape == (6, cfg.seq_len)
    ended_early = 0
    for row, supervised in zip(data.tokens.tolist(), data.supervised.tolist()):
        assert not any(supervised[:prompt_len]) and supervised[prompt_len]
        written = supervised.index(False, prompt_len) if False in supervised[prompt_len:] else cfg.seq_len
        assert not any(supervised[written:]) and all(t == ByteTokenizer.PAD for t in row[written:])
        greedy = target.model.generate(torch.tensor([row[:prompt_len]]), max_new_tokens=written - prompt_len)
        assert row[:written] == greedy[0].tolist()[:written], "the target's own greedy continuation"
        if written < cfg.seq_len:
            ended_early += 1
            assert row[written - 1] == frequent and frequent not in row[prompt_len : written - 1], "its first EOS"
    assert ended_early > 0
    batch = make_step_batch(data, 0, batch_size=4, seq_len=cfg.seq_len, num_anchors=6, block_size=8, gamma=4.0, seed=0)
    ids = batch.input_ids
    rows = [next(i for i in range(len(data.tokens)) if torch.equal(data.tokens[i], ids[b])) for b in range(4)]
    supervised = data.supervised[rows]
    for b in range(4):
        for a in batch.anchors[b][batch.keep[b]].tolist():
            assert supervised[b, a] and supervised[b, a + 1]
    positions = batch.anchors.unsqueeze(-1) + torch.arange(8)
    labelled = positions.clamp(max=cfg.seq_len - 1)
    assert not (batch.weights > 0)[~torch.gather(supervised, 1, labelled.flatten(1)).view_as(labelled)].any()


# --- --compile-mode reduce-overhead, on the CPU (issue 11) -------------------------------------------------


@pytest.fixture
def cudagraph_code_on_cpu(monkeypatch) -> list[str]:
    """The trainer's --compile-mode code path run on the CPU: the CPU check off, each replica's layers compiled
    as on CUDA (the checkpoint inside) but by the eager backend, and the steps marked for CUDA graphs, as they
    are on CUDA. Returns the names of the threads that marked a step, one entry per mark."""
    from dflash_train import config as config_module
    from dflash_train import train as train_module

    marks: list[str] = []
    real_compile_replica = train_module.compile_replica

    def compile_replica(replica, device, cfg):
        if cfg.compile_mode == "default":
            return real_compile_replica(replica, device, cfg)
        replica.compile_training("eager", cfg.compile_mode)

    monkeypatch.setattr(config_module, "check_compile_mode", lambda cfg: None)
    monkeypatch.setattr(train_module, "compile_replica", compile_replica)
    monkeypatch.setattr(train_module, "uses_cudagraphs", lambda cfg, device: cfg.compile_mode == "reduce-overhead")
    monkeypatch.setattr(
        torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(threading.current_thread().name)
    )
    return marks


def test_every_drafter_thread_marks_each_of_its_steps_for_cuda_graphs(tiny, cudagraph_code_on_cpu):
    eager = train(dataclasses.replace(tiny, steps=3, out_dir=tiny.out_dir + "-eager"))
    cfg = dataclasses.replace(tiny, steps=3, compile=True, compile_mode="reduce-overhead")
    result = train(cfg)
    assert result.final_loss == pytest.approx(eager.final_loss, rel=1e-6)
    # Each drafter thread marks each of its steps; the target thread marks none (it runs no CUDA graph).
    assert sorted(cudagraph_code_on_cpu) == ["drafter-0 (cpu)"] * 3 + ["drafter-1 (cpu)"] * 3
    records = [json.loads(line) for line in open(cfg.out_dir + "/metrics.jsonl")]
    assert records[-1]["type"] == "summary" and records[-1]["compile_mode"] == "reduce-overhead"
    assert next(r for r in records if r["type"] == "dynamo")["eager_fallback"] is False


def test_a_failure_inside_the_compiled_layer_stops_the_job(tiny, cudagraph_code_on_cpu, monkeypatch):
    """An error raised while a compiled (on CUDA: CUDA-graphed) layer runs reaches the worker-exception path:
    the job stops with the failing thread's name and traceback."""
    from dflash_train import train as train_module

    calls = [0]

    @torch.library.custom_op("dflash_test::fail_on_call", mutates_args=())
    def fail_on_call(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 7:  # in the second step: after the first one's compile and barrier
            raise RuntimeError("failure inside the compiled layer")
        return x.clone()

    fail_on_call.register_fake(lambda x: torch.empty_like(x))
    fail_on_call.register_autograd(lambda ctx, grad: grad)

    class Failing(torch.nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def forward(self, *args):
            return fail_on_call(self.layer(*args))

    def compile_failing(replica, device, cfg):
        replica.layers[-1] = Failing(replica.layers[-1])
        replica.compile_training("eager", cfg.compile_mode)

    monkeypatch.setattr(train_module, "compile_replica", compile_failing)
    cfg = dataclasses.replace(tiny, steps=20, compile=True, compile_mode="reduce-overhead")
    with pytest.raises(WorkerFailed, match=r"worker thread 'drafter-\d \(cpu\)' failed") as failed:
        train(cfg)
    assert "RuntimeError: failure inside the compiled layer" in str(failed.value)
    assert "Traceback (most recent call last)" in str(failed.value)


def test_a_target_worker_exception_stops_the_job_with_its_traceback(tiny, monkeypatch):
    from dflash_train import faults

    monkeypatch.setattr(faults, "armed", None)  # disarmed again after the test
    faults.arm("raise@target:2")
    with pytest.raises(WorkerFailed, match=r"worker thread 'target-0 \(cpu\)' failed") as failed:
        train(dataclasses.replace(tiny, steps=50))
    assert "Traceback (most recent call last)" in str(failed.value)
    assert "RuntimeError: injected fault: target worker at step 2" in str(failed.value)


# --- export: the folder DFlash serving code loads (issue 15) ----------------------------------------------


def test_export_loads_back_from_its_folder_with_the_same_logits_and_drafts(tiny, tmp_path):
    from dflash_train.evaluate import acceptance_length
    from dflash_train.export import export_run, load_exported
    from dflash_train.target import load_target

    cfg = dataclasses.replace(tiny, steps=3, export=str(tmp_path / "bf16"))
    trained = train(cfg).drafters[0]
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["num_target_layers"] == 5
    assert (
        config["block_size"] == 8
        and config["dflash_config"]["target_layer_ids"] == trained.config.dflash_config["target_layer_ids"]
    )
    assert config["dflash_config"]["mask_token_id"] == trained.mask_token_id and config["dtype"] == "bfloat16"
    saved = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    per_layer = [f"self_attn.{p}_proj" for p in "qkvo"] + ["self_attn.q_norm", "self_attn.k_norm"]
    per_layer += [f"mlp.{p}_proj" for p in ("gate", "up", "down")] + ["input_layernorm", "post_attention_layernorm"]
    expected = {f"layers.{i}.{part}.weight" for i in range(cfg.drafter_layers) for part in per_layer}
    assert set(saved) == expected | {"fc.weight", "hidden_norm.weight", "norm.weight"}
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}

    # From the run's checkpoint, in float32: the drafter it loads back is the trained one.
    folder = export_run(cfg.out_dir, tmp_path / "fp32", dtype="float32")
    assert config["dflash_train"]["target"].startswith("dflash_train's tiny byte-level target (tiny-target-")
    with safe_open(cfg.out_dir + "/checkpoint.safetensors", framework="pt") as f:  # where this machine keeps it
        target = load_target(f.metadata()["target_path"], torch.device("cpu"), cfg.drafter_layers)
    loaded = load_exported(folder, target).eval()
    trained.eval()
    features = target.features(torch.randint(0, 256, (1, 24)))
    for anchor in (10, 65, 200):
        torch.testing.assert_close(loaded.draft_logits(features, anchor), trained.draft_logits(features, anchor))
    prompts = [torch.randint(0, 256, (16,)) for _ in range(2)]
    assert acceptance_length(target, loaded, prompts, 24) == acceptance_length(target, trained, prompts, 24)


def test_export_refuses_bad_input_with_one_message(tiny, tmp_path):
    from dflash_train.export import export_run

    with pytest.raises(ConfigError, match="no checkpoint.safetensors"):
        export_run(tmp_path / "nothing", tmp_path / "out")
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="corrupt"):
        export_run(run, tmp_path / "out")
    cfg = dataclasses.replace(tiny, steps=1, out_dir=str(run), overwrite=True)  # over the bad checkpoint
    train(cfg)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not an exported drafter"):
        export_run(run, other)
    assert (other / "keep.txt").read_text() == "mine"
    with pytest.raises(ConfigError, match="--dtype"):
        export_run(run, tmp_path / "out", dtype="int8")


# --- TensorBoard and MFU (issue 16) ---------------------------------------------------------------------------


def test_tensorboard_events_hold_the_metrics_and_mfu_is_none_on_the_cpu(tiny, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = dataclasses.replace(tiny, steps=3, eval_prompts=1, eval_prompt_len=16, eval_new_tokens=8)
    result = train(dataclasses.replace(cfg, tensorboard=str(tmp_path / "tb")))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    records = [json.loads(line) for line in open(cfg.out_dir + "/metrics.jsonl")]
    train_records = [r for r in records if r["type"] == "train"]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([r["loss"] for r in train_records])
    assert [e.step for e in events.Scalars("eval/tau")] == [0, 3]
    assert {"train/acc", "train/lr", "eval/tau_pooled"} <= set(events.Tags()["scalars"])
    assert result.mfu is None and records[-1]["mfu"] is None  # no peak to compare with on a CPU


def test_tensorboard_without_its_package_is_one_clear_message(tiny, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if the package were not installed
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        train(dataclasses.replace(tiny, steps=1, tensorboard=str(tmp_path / "tb")))


# --- profiling (issue 14) -------------------------------------------------------------------------------------


def test_profile_steps_records_every_threads_ops_in_its_window(tiny):
    """A target thread and two drafter threads: the profile holds the ops of several threads (torch's profiler
    alone records only the thread that started it, here the main thread, which runs none), and the profiler is
    off again after the job."""
    train(dataclasses.replace(tiny, steps=5, profile_steps="2:4"))
    profile = Path(tiny.out_dir) / "profile"
    ops = json.loads((profile / "ops.json").read_text())
    calls = {o["op"]: o["calls"] for o in ops["ops"]}
    assert ops["steps"] == 2 and calls.get("aten::_fused_adamw_", 0) >= 1, calls  # a replica's optimizer step
    trace = json.loads((profile / "trace.json").read_text())["traceEvents"]
    threads = {e["tid"] for e in trace if e.get("cat") == "cpu_op"}
    assert len(threads) >= 2, threads
    assert not torch.autograd.profiler._is_profiler_enabled
