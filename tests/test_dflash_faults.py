"""dflash_train when things go wrong around it (issue 32): SIGTERM, a second run on one --out-dir, a kill
between checkpoints, a full disk, damaged cache files, another user's compile cache, an export folder that
is not ours. Signals and kills hit real subprocesses; the rest runs in-process where it can."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_dflash_cli import _env, main_env, run_cli, start_training, tiny_flags  # noqa: F401  (main_env: a fixture)
from test_dflash_training import tiny  # noqa: F401  (a fixture)

from dflash_train.__main__ import main
from dflash_train.config import ConfigError

REPO = Path(__file__).resolve().parents[1]


def checkpoint_step(run: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(run / "checkpoint.safetensors"), framework="pt") as f:
        return int(f.metadata()["step"])


def train_steps(metrics: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if r["type"] == "train"]


# --- signals ------------------------------------------------------------------------------------------


def test_sigterm_saves_a_checkpoint_exits_143_and_prints_the_resume_command(tmp_path):
    # No save of its own before the signal's: the checkpoint can only come from SIGTERM.
    args = [*tiny_flags(tmp_path), "--no-compile", "--eval-prompts", "0", "--steps", "100000", "--save-every", "0"]
    proc = start_training(args, tmp_path / "run" / "metrics.jsonl")
    try:
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "SIGTERM: finishing this step and saving a checkpoint" in stdout
    step = int(stderr.split("interrupted at step ")[1].split(";")[0])
    assert checkpoint_step(tmp_path / "run") == step
    command = stderr.split("Continue it with: ")[1].splitlines()[0]  # as Ctrl-C's (run in test_dflash_cli)
    assert command == f"python -m dflash_train --resume --out-dir {tmp_path / 'run'}", command


# --- a second run, a kill between checkpoints --------------------------------------------------------


def test_a_killed_run_resumes_with_consistent_metrics_and_no_leftovers(tmp_path):
    """While a run trains, a second run on its --out-dir is refused, whatever its flags. Killed (SIGKILL) two
    steps past its last checkpoint, in the middle of a metrics line and of a save, it resumes with every step
    logged once, a resume record where it picked up, the torn line and the temporary files gone."""
    run, metrics = tmp_path / "run", tmp_path / "run" / "metrics.jsonl"
    flags = [*tiny_flags(tmp_path), "--no-compile", "--eval-prompts", "0", "--save-every", "4"]
    # Steps 1 to 6 done, the checkpoint of step 4 saved, and no further: a drafter hangs in step 7.
    proc = start_training([*flags, "--steps", "100000"], metrics, fault="hang@drafter:6")
    try:
        # As a new run (the folder holds a run) and as --resume (no checkpoint yet): the lock is what they hear.
        for again in ([], ["--resume"]):
            second = run_cli([*flags, "--steps", "1", *again], timeout=120)
            assert second.returncode == 2, second.stderr
            assert second.stderr == (
                f"dflash-train: error: --out-dir {run} is in use by another run (process {proc.pid}): wait for it "
                "to end or give another --out-dir\n"
            )
        deadline = time.monotonic() + 120
        while train_steps(metrics)[-1:] != [6]:
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.communicate()
    saved = checkpoint_step(run)
    logged = train_steps(metrics)
    assert (saved, logged) == (4, [1, 2, 3, 4, 5, 6])
    with metrics.open("a") as f:
        f.write('{"type": "train", "step": 9')  # a record cut short
    leftovers = [run / "checkpoint.safetensors.123.dflash-tmp", run / ".tmpAb12Cd"]  # ours, safetensors'
    for leftover in leftovers:
        leftover.write_bytes(b"partial")

    ran = run_cli([*flags, "--steps", str(saved + 2), "--resume"])
    assert ran.returncode == 0, ran.stderr
    assert f"dropped 2 records of the steps after {saved}" in ran.stderr
    assert "skipped line" in ran.stderr and "Traceback" not in ran.stderr
    assert not any(p.exists() for p in leftovers) and ".tmpAb12Cd" in ran.stdout
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert train_steps(metrics) == list(range(1, saved + 3))
    resume = [r for r in records if r["type"] == "resume"]
    assert len(resume) == 1 and resume[0]["step"] == saved
    assert records.index(resume[0]) == [r.get("step") for r in records].index(saved + 1) - 1
    assert (run / "plot.png").is_file()


# --- a full disk ----------------------------------------------------------------------------------------


def _can_mount_in_a_namespace() -> bool:
    probe = ["unshare", "--user", "--map-root-user", "--mount", "true"]
    return shutil.which("unshare") is not None and subprocess.run(probe, capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_mount_in_a_namespace(), reason="needs unshare and user namespaces for a small tmpfs")
def test_a_full_disk_is_one_line_naming_the_folder_and_the_space_a_save_needs(tmp_path):
    small = tmp_path / "small"  # a 2 MB filesystem: the metrics fit, a checkpoint (5 MB) does not
    small.mkdir()
    args = [
        *tiny_flags(tmp_path),
        "--no-compile",
        "--eval-prompts",
        "0",
        "--steps",
        "2",
        "--out-dir",
        str(small / "run"),
    ]
    mount = 'mount -t tmpfs -o size=2m tmpfs "$0" && exec "$@"'
    ran = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mount, str(small)]
        + [sys.executable, "-m", "dflash_train", *args],
        capture_output=True, text=True, timeout=240, env=_env(), cwd=REPO,
    )  # fmt: skip
    assert ran.returncode == 1, ran.stderr
    line = f"dflash-train: error: no space left to save checkpoint.safetensors in {small / 'run'}: it needs 5."
    assert line in ran.stderr and "Traceback" not in ran.stderr, ran.stderr
    assert "MB are free there" in ran.stderr


def test_a_checkpoint_reaches_the_disk_before_its_rename(tmp_path, monkeypatch):
    import torch

    from dflash_train.files import save_safetensors

    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(
        os, "fsync", lambda fd: (calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))), real_fsync(fd))
    )
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append(("replace", str(a))), real_replace(a, b)))
    save_safetensors(tmp_path / "checkpoint.safetensors", {"w": torch.ones(4)})
    tmp = str(tmp_path / f"checkpoint.safetensors.{os.getpid()}.dflash-tmp")
    assert calls[calls.index(("replace", tmp)) - 1] == ("fsync", tmp)
    assert calls[-1] == ("fsync", str(tmp_path))  # the rename itself
    assert os.listdir(tmp_path) == ["checkpoint.safetensors"]


# --- damaged cache files ----------------------------------------------------------------------------------


def test_a_damaged_cached_target_or_data_file_is_made_again(tiny, tmp_path, capsys):  # noqa: F811
    from safetensors.torch import load_file

    from dflash_train.train import train

    # Each train() a new run in the one --out-dir: the cache is what they share.
    cfg = dataclasses.replace(tiny, cache_dir=str(tmp_path / "cache"), regenerate=8, steps=1, overwrite=True)
    train(cfg)
    (target,) = (tmp_path / "cache").glob("tiny-target-*")
    (data,) = (tmp_path / "cache").glob("regenerated-*.safetensors")  # made with that target: damaged first
    data.write_bytes(data.read_bytes()[:1000])  # cut short (by a crash, a full disk)
    capsys.readouterr()
    assert train(cfg).steps_done == 1
    assert f"the cached data {data} is damaged" in capsys.readouterr().err
    load_file(data)  # whole again
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert train(dataclasses.replace(cfg, regenerate=0)).steps_done == 1  # (data made with the new target: no test)
    assert f"the cached tiny target {target} is damaged" in capsys.readouterr().err
    load_file(weights)


# --- the compile cache --------------------------------------------------------------------------------------


def test_the_compile_cache_is_a_private_folder_of_the_cache_dir(tmp_path, main_env):  # noqa: F811
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    assert main([*tiny_flags(tmp_path), "--no-compile", "--eval-prompts", "0", "--steps", "1"]) == 0
    folder = tmp_path / "cache" / "inductor"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    assert folder.stat().st_mode & 0o777 == 0o700 and folder.stat().st_uid == os.geteuid()
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert cache_dir() == str(folder)  # where Inductor writes and imports its code


@pytest.mark.parametrize(
    "who", ["others can write", "another user owns", "another user owns the link", "another user owns TRITON_CACHE_DIR"]
)
def test_a_compile_cache_that_is_not_private_is_refused(tmp_path, capsys, main_env, who):  # noqa: F811
    folder = tmp_path / "cache" / "inductor"
    folder.parent.mkdir()
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    variable = "TORCHINDUCTOR_CACHE_DIR"
    if who == "others can write":
        folder.mkdir(mode=0o777)
        folder.chmod(0o777)
        problem = "can be written by other users (mode drwxrwxrwx)"
    else:
        if os.geteuid() != 0:
            pytest.skip("a folder another user owns is made by root (chown to nobody)")
        problem = "is owned by another user (uid 65534)"
        if who.endswith("the link"):  # to a folder of mine: its owner could point it to theirs
            (tmp_path / "mine").mkdir(mode=0o700)
            folder.symlink_to(tmp_path / "mine")
            os.lchown(folder, 65534, 65534)
        else:
            folder.mkdir()
            os.chown(folder, 65534, 65534)
        if who.endswith("TRITON_CACHE_DIR"):
            variable = "TRITON_CACHE_DIR"
            os.environ[variable] = str(folder)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "mine")
    with pytest.raises(SystemExit) as exit_info:
        main(tiny_flags(tmp_path))  # a run that would start
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"dflash-train: error: compile cache {folder} ({variable}) {problem}: "), err
    # Refused before anything ran: no target built, no run begun.
    assert not list((tmp_path / "cache").glob("tiny-target-*")) and not (tmp_path / "run" / "config.toml").exists()


# --- the export folder -------------------------------------------------------------------------------------------


def test_export_writes_only_into_a_new_empty_or_earlier_export_folder(tiny, tmp_path, capsys, main_env):  # noqa: F811
    from dflash_train.export import export_run
    from dflash_train.run_dir import EXPORT_MARKER
    from dflash_train.train import train

    train(dataclasses.replace(tiny, steps=1))
    run = tiny.out_dir
    model = tmp_path / "model"  # a Hugging Face model folder: it has a config.json too
    model.mkdir()
    mine = {"config.json": '{"model_type": "qwen3"}', "model.safetensors": "weights", "NOTES.txt": "mine"}
    for name, text in mine.items():
        (model / name).write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        main(["export", run, str(model)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert f"export folder {model} holds files and is not an exported drafter" in err
    assert {p.name: p.read_text() for p in model.iterdir()} == mine

    out = tmp_path / "out"
    out.mkdir()  # empty
    export_run(run, out)
    assert (out / EXPORT_MARKER).is_file() and (out / "README.md").is_file()  # the model card is the export's
    export_run(run, out)  # over an earlier export
    (out / "NOTES.md").write_text("my notes")
    with pytest.raises(ConfigError, match=r"an earlier export with files added \(NOTES.md\)"):
        export_run(run, out)
    with pytest.raises(SystemExit) as exit_info:  # the command line refuses it at start, before torch
        main(["export", run, str(out)])
    assert exit_info.value.code == 2 and "an earlier export with files added (NOTES.md)" in capsys.readouterr().err
    assert (out / "NOTES.md").read_text() == "my notes"
    (tmp_path / "file").write_text("a file")
    with pytest.raises(ConfigError, match="is a file"):
        export_run(run, tmp_path / "file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "model", "out"]  # no temporary folder left
