"""dflash_train under torchrun: 2 CPU ranks (gloo) in subprocesses with timeouts. Two ranks of one
drafter thread train exactly what one process of two threads trains, resume exactly, and a rank that
fails stops the whole job with its error instead of hanging it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import _test_env, forked_python
from safetensors import safe_open
from safetensors.torch import load_file
from test_dflash_cli import REPO, TRAINER_IMPORTS, run_cli, start_training, tiny_flags

from dflash_train.config import ConfigError, TrainConfig

# One worker runs this file under pytest-xdist: its 2-rank run is a module fixture, made once.
pytestmark = pytest.mark.xdist_group("two-ranks")

TWO_RANKS = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
STEPS = 4


def flags(tmp_path: Path, out: str) -> list[str]:
    """Eager layers (compilation is tested in one process), one drafter thread per rank, short runs."""
    return [
        *tiny_flags(tmp_path), "--out-dir", str(tmp_path / out), "--no-compile", "--drafter-threads-per-device", "1",
        "--steps", str(STEPS), "--warmup-steps", "2", "--eval-prompts", "0",
    ]  # fmt: skip


def checkpoint(tmp_path: Path, out: str) -> dict[str, torch.Tensor]:
    return load_file(tmp_path / out / "checkpoint.safetensors")


def records(tmp_path: Path, out: str) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """An uninterrupted 2-rank run (with tau, evaluated by rank 0 while rank 1 waits)."""
    tmp_path = tmp_path_factory.mktemp("two-ranks")
    ran = run_cli([*flags(tmp_path, "straight"), "--eval-prompts", "2"], launcher=TWO_RANKS)
    assert ran.returncode == 0, ran.stderr
    assert f"done: {STEPS} steps" in ran.stdout and ran.stdout.count("done:") == 1  # rank 0 alone reports
    assert "tau after training" in ran.stdout
    return tmp_path


def test_two_ranks_train_what_one_process_of_two_threads_trains(two_ranks):
    one = run_cli([*flags(two_ranks, "one-process"), "--drafter-threads-per-device", "2"])
    assert one.returncode == 0, one.stderr
    a, b = checkpoint(two_ranks, "straight"), checkpoint(two_ranks, "one-process")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4, msg=f"{name} differs")
    losses = [
        [r["loss"] for r in records(two_ranks, out) if r["type"] == "train"] for out in ("straight", "one-process")
    ]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5) and len(losses[0]) == STEPS
    # Rank 0's metrics hold both ranks' first-step times and compile counters.
    straight = records(two_ranks, "straight")
    assert sorted(r["rank"] for r in straight if r["type"] == "first_step") == [0, 1]
    assert sorted(r["rank"] for r in straight if r["type"] == "dynamo") == [0, 1]


def test_one_rank_under_torchrun_trains_what_a_plain_process_trains(tmp_path):
    # Launched by torchrun, even one rank starts the process group and all-reduces every step.
    launched = run_cli(flags(tmp_path, "one-rank"), launcher=TWO_RANKS[:-1] + ("1",))
    plain = run_cli(flags(tmp_path, "plain"))
    assert launched.returncode == 0 and plain.returncode == 0, launched.stderr + plain.stderr
    a, b = checkpoint(tmp_path, "one-rank"), checkpoint(tmp_path, "plain")
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_resumed_two_rank_run_continues_exactly(two_ranks):
    cut = run_cli([*flags(two_ranks, "cut"), "--stop-after", "2"], launcher=TWO_RANKS)
    assert cut.returncode == 0, cut.stderr
    resumed = run_cli([*flags(two_ranks, "cut"), "--resume"], launcher=TWO_RANKS)
    assert resumed.returncode == 0, resumed.stderr
    assert f"done: {STEPS} steps" in resumed.stdout
    a, b = checkpoint(two_ranks, "straight"), checkpoint(two_ranks, "cut")
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    for name in a:  # weights and optimizer state, bit for bit
        assert torch.equal(a[name], b[name]), name


def test_a_failing_rank_stops_the_job_with_its_error(tmp_path):
    ran = run_cli([*flags(tmp_path, "run"), "--steps", "100"], launcher=TWO_RANKS, fault="raise@drafter:2")
    assert ran.returncode != 0
    assert "dflash-train (rank 1): worker thread 'drafter-0 (cpu)' failed" in ran.stderr, ran.stderr
    assert "RuntimeError: injected fault: drafter worker at step 2" in ran.stderr
    assert "done:" not in ran.stdout
    # The other rank's all-reduce fails, and it says so and ends: it once hung in its barrier's action until
    # torchrun killed it, 30 s after asking it to stop.
    assert "dflash-train (rank 0): worker thread 'drafter-0 (cpu)' failed" in ran.stderr, ran.stderr
    assert "SIGKILL" not in ran.stderr, ran.stderr


def test_batch_must_split_across_every_thread_of_every_rank(monkeypatch):
    for name, value in dict(RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, LOCAL_WORLD_SIZE=2).items():
        monkeypatch.setenv(name, str(value))
    with pytest.raises(ConfigError, match=r"--batch-size \(2\).*\(4 = ranks x devices"):
        TrainConfig(batch_size=2).resolved()


def test_ranks_with_different_thread_counts_get_one_message(tmp_path):
    """Two processes started by hand (torchrun passes every rank the same flags), forked as torchrun's are."""
    client, client_env = forked_python(TRAINER_IMPORTS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = _test_env(env=dict(
            client_env, PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
        ))  # fmt: skip
        threads = ["--drafter-threads-per-device", str(rank + 1), "--batch-size", "12"]
        procs.append(
            subprocess.Popen(
                [sys.executable, *client, "-m", "dflash_train", *flags(tmp_path, f"rank{rank}"), *threads],
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                cwd=REPO,
            )  # fmt: skip
        )
    try:
        errors = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [2, 2], errors
    for rank, err in enumerate(errors):
        assert f"every rank needs the same number of drafter threads: here {rank + 1}, on the ranks 1 to 2" in err


def rank_pid(launcher: int, rank: int) -> int:
    """The process of ``rank`` among the children of the torchrun process ``launcher`` (Linux /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if parent == launcher and f"\0RANK={rank}\0" in (stat.parent / "environ").read_text():
                return int(stat.parent.name)
    raise AssertionError(f"no process of rank {rank}")


def test_ctrl_c_on_one_rank_stops_every_rank_at_one_step_with_a_checkpoint(tmp_path):
    args = [*flags(tmp_path, "run"), "--steps", "100000"]
    proc = start_training(args, tmp_path / "run" / "metrics.jsonl", launcher=TWO_RANKS)
    try:
        os.kill(rank_pid(proc.pid, 1), signal.SIGINT)  # rank 0 must stop with it, at the same step
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "dflash-train: interrupted at step" in stderr and "--resume" in stderr, stderr  # rank 0's report
    step = int(stderr.split("interrupted at step ")[1].split(";")[0])
    with safe_open(str(tmp_path / "run" / "checkpoint.safetensors"), framework="pt") as f:
        assert int(f.metadata()["step"]) == step
