"""``python -m dflash_train`` end to end, in subprocesses with timeouts: a short threaded and compiled
run, the error paths (worker exception, watchdog, Ctrl-C) and the one-line errors for bad input."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import _test_env, fork_python, forked_python

from dflash_train.__main__ import main

REPO = Path(__file__).resolve().parents[1]


def tiny_flags(tmp_path: Path) -> list[str]:
    """An untrained tiny target and short sequences: seconds per run, two drafter threads."""
    return [
        "--tiny-target-steps", "0", "--regenerate", "0",
        "--cache-dir", str(tmp_path / "cache"), "--out-dir", str(tmp_path / "run"),
        "--seq-len", "48", "--batch-size", "4", "--num-anchors", "6", "--loss-chunk", "4",
        "--eval-prompts", "2", "--eval-prompt-len", "16", "--eval-new-tokens", "12",
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return _test_env(env={"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})


# What the trainer imports that takes its CPU seconds (torch's flex attention imports Dynamo; the torch.compile at
# dflash_train.masks' import, Inductor's compile_fx and Dynamo's repro): a plain run, and each rank a launcher starts,
# is forked from an interpreter that has imported them (conftest.fork_python, conftest.forked_python), ~7 CPU s less a
# process. Not torchfix nor dflash_train: the run imports them itself, torchfix first, as it does fresh. One
# difference: the server's import of Dynamo fixed DynamoCache's folder (torch._dynamo.package, read only with
# caching_precompile, off) under Inductor's default cache folder; every other read of TORCHINDUCTOR_CACHE_DIR is live,
# and the run's environment has none from the server: the trainer points it at its own private folder, as it does
# fresh.
TRAINER_IMPORTS = (
    "torch.nn.attention.flex_attention", "torch.distributed", "torch.utils.checkpoint", "transformers",
    "transformers.models.qwen3.modeling_qwen3", "safetensors.torch", "tqdm", "matplotlib.pyplot",
    "torch._inductor.compile_fx", "torch._dynamo.repro.after_dynamo",
)  # fmt: skip


# The command line with a fault armed (dflash_train.faults): how the tests of the error paths make a worker fail.
WITH_FAULT = str(Path(__file__).parent / "dflash_with_fault.py")


def _trainer(launcher: tuple[str, ...], fault: str) -> tuple[list[str], dict[str, str]]:
    """What follows ``python`` to run the trainer, and its environment: a launcher's processes are forked
    (conftest.forked_python) and get the signals the launcher sends, as fresh ones would."""
    program = [WITH_FAULT, fault] if fault else ["-m", "dflash_train"]
    if not launcher:
        return program, _env()
    client, env = forked_python(TRAINER_IMPORTS)
    return [*launcher, *client, *program], {**_env(), **env}


def run_cli(args: list[str], timeout: float = 240, launcher: tuple[str, ...] = (), fault: str = ""):
    """``python [launcher] -m dflash_train args``; ``launcher`` runs it under torchrun, for instance; ``fault``
    ('raise@drafter:2') arms a fault in it first. Forked (TRAINER_IMPORTS): without a launcher the run itself, which
    no test of this helper sends a signal; with one, each process the launcher starts. A run without a launcher that
    is sent signals starts fresh (start_training): a forked child would keep its server's signal handling."""
    program, env = _trainer(launcher, fault)
    argv = [*program, *args]
    if not launcher:
        return fork_python(argv, preload=TRAINER_IMPORTS, env=env, cwd=str(REPO), timeout=timeout)
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def _default_sigint() -> None:
    # Tests run from a script in the background (`cmd &`) inherit SIGINT ignored, and Python keeps
    # ignoring it: the trainer would never see the test's Ctrl-C.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_training(args: list[str], metrics: Path, launcher: tuple[str, ...] = (), fault: str = "") -> subprocess.Popen:
    """Start ``python [launcher] -m dflash_train args`` (``fault``: as ``run_cli``'s) and return once ``metrics``
    holds a training step."""
    program, env = _trainer(launcher, fault)
    proc = subprocess.Popen(
        [sys.executable, "-u", *program, *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
        preexec_fn=_default_sigint,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and '"train"' in metrics.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no training step reported: {proc.communicate()}")
        time.sleep(0.2)
    return proc


def test_smoke_threads_compile_checkpoint(tmp_path):
    """The main job, shortened: training data regenerated by the target, 2 drafter threads compiling their
    layers concurrently (aot_eager: Dynamo and AOTAutograd tracing, without the C++ compile), tau
    before/after, every output written, each thread's time to its first step, Dynamo's counters and peak memory."""
    flags = ["--steps", "3", "--backend", "aot_eager", "--regenerate", "8", "--compile-mode", "default"]
    ran = run_cli([*tiny_flags(tmp_path), *flags])
    assert ran.returncode == 0, ran.stderr
    assert "tau before training" in ran.stdout and "tau after training" in ran.stdout
    assert "done: 3 steps" in ran.stdout
    # Output to a pipe: plain lines, no progress bar (nor its carriage returns), a word while the first step compiles.
    assert "\r" not in ran.stdout + ran.stderr
    assert "drafter: compiling the first step" in ran.stdout and "drafter step 3/3: loss " in ran.stdout
    out = tmp_path / "run"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["type"] == "train"] == [1, 2, 3]
    kinds = ["eval", "eval", "first_step", "first_step", "dynamo", "memory", "summary"]
    assert [r["type"] for r in records if r["type"] != "train"] == kinds
    first = [r for r in records if r["type"] == "first_step"]
    assert {r["thread"] for r in first} == {"drafter-0 (cpu)", "drafter-1 (cpu)"}
    assert all(0 < r["seconds"] <= records[-1]["elapsed_s"] and r["rank"] == 0 for r in first)
    dynamo = next(r for r in records if r["type"] == "dynamo")
    assert dynamo["unique_graphs"] > 0 and dynamo["eager_fallback"] is False, dynamo
    assert dynamo["cudagraph_skips"] == 0 and records[-1]["compile_mode"] == "default"
    memory = next(r for r in records if r["type"] == "memory")
    assert memory["rank"] == 0 and 0.1 < memory["host_rss"] < 64, memory  # GiB
    assert "first step done (from the job's start, compilation included): drafter-" in ran.stdout
    assert "graphs; no eager fallback" in ran.stdout
    assert (out / "plot.png").stat().st_size > 1000
    assert (out / "checkpoint.safetensors").is_file()
    assert len(list((tmp_path / "cache").glob("regenerated-*.safetensors"))) == 1


def test_worker_exception_stops_the_job_with_its_traceback(tmp_path):
    # A drafter thread's here; a target thread's in-process (test_dflash_training), the same path to this message.
    ran = run_cli([*tiny_flags(tmp_path), "--steps", "50", "--no-compile"], timeout=120, fault="raise@drafter:2")
    assert ran.returncode == 1, ran.stderr
    assert "worker thread 'drafter-1 (cpu)' failed" in ran.stderr  # the last drafter thread
    assert "Traceback (most recent call last)" in ran.stderr
    assert "RuntimeError: injected fault" in ran.stderr
    assert "done:" not in ran.stdout


def test_watchdog_prints_every_stack_and_exits(tmp_path):
    args = [*tiny_flags(tmp_path), "--steps", "50", "--no-compile", "--watchdog-timeout", "4"]
    ran = run_cli(args, timeout=120, fault="hang@drafter:1")
    assert ran.returncode == 3, ran.stderr
    assert "watchdog: no progress" in ran.stderr
    for name in ("drafter-0 (cpu)", "drafter-1 (cpu)", "target-0 (cpu)", "MainThread"):
        assert f"--- thread '{name}'" in ran.stderr
    assert "in inject" in ran.stderr  # the hung thread's own frame (faults.Fault.inject)


def test_ctrl_c_saves_a_checkpoint_and_resume_continues(tmp_path):
    flags = [*tiny_flags(tmp_path), "--no-compile", "--eval-prompts", "0"]
    proc = start_training([*flags, "--steps", "100000"], tmp_path / "run" / "metrics.jsonl")
    try:
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    step = int(stderr.split("interrupted at step ")[1].split(";")[0])
    command = stderr.split("Continue it with: ")[1].splitlines()[0]
    assert command == f"python -m dflash_train --resume --out-dir {tmp_path / 'run'}"
    # That command, and one change (the run was to go on for 100000 steps): named, and applied.
    ran = run_cli([*shlex.split(command)[3:], "--steps", str(step + 2)])
    assert ran.returncode == 0, ran.stderr
    assert f"from step {step} with its settings" in ran.stdout and "changed: --steps 100000 -> " in ran.stdout
    assert f"done: {step + 2} steps" in ran.stdout


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_second_stop_signal_quits_at_once(tmp_path, stop):
    # A drafter stuck in its step: the first Ctrl-C (or SIGTERM, a scheduler's) waits for that step, the second
    # leaves without it. The watchdog (30 s) ends the run with exit code 3 if the second one does not.
    flags = [*tiny_flags(tmp_path), "--no-compile", "--eval-prompts", "0", "--watchdog-timeout", "30"]
    proc = start_training([*flags, "--steps", "50"], tmp_path / "run" / "metrics.jsonl", fault="hang@drafter:2")
    announced = "Ctrl-C" if stop == signal.SIGINT else "SIGTERM"
    try:
        proc.send_signal(stop)
        for line in proc.stdout:  # unbuffered (-u): the line shows once the first signal was handled
            if line.startswith(f"{announced}: finishing this step"):
                break
        proc.send_signal(stop)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + stop, stderr
    assert "dflash-train: interrupted" in stderr and "checkpoint saved" not in stderr


@pytest.fixture
def main_env(monkeypatch):
    """main() sets environment variables for the process (OMP_WAIT_POLICY): keep them out of the
    environment that later tests hand to their subprocesses."""
    monkeypatch.setattr(os, "environ", dict(os.environ))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--drafter-devices", "gpu:0"], "'gpu:0' is not a device"),
        (["--batch-size", "3"], "must be divisible by the number of drafter threads of the job (2 = "),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--target", "/nonexistent/model"], "not a local Hugging Face model folder"),
        (["--config", "/nonexistent.toml"], "config file /nonexistent.toml does not exist"),
        (["--resume"], "no checkpoint at "),
        (
            ["--compile-mode", "fast"],
            "--compile-mode 'fast': use 'default', 'reduce-overhead', 'max-autotune-no-cudagraphs'",
        ),
        (
            ["--compile-mode", "reduce-overhead"],
            "--compile-mode reduce-overhead is for CUDA drafters, and the drafter ",
        ),
        (["--compile-mode", "max-autotune-no-cudagraphs"], "--compile-mode max-autotune-no-cudagraphs is for CUDA "),
        (["--cuda-streams", "two"], "--cuda-streams 'two': use 'per-thread' or 'shared'"),
        (["--profile-steps", "3"], "--profile-steps '3': use FIRST:LAST with 1 <= FIRST < LAST <= --steps"),
        (["--steps", "5", "--profile-steps", "2:9"], "--profile-steps '2:9': use FIRST:LAST with 1 <= FIRST < "),
        (
            ["--drafter-devices", "cuda:0", "--compile-mode", "reduce-overhead", "--no-compile"],
            "--compile-mode reduce-overhead compiles the drafter layers: it cannot go with --no-compile",
        ),
    ],
)
def test_bad_input_gets_one_clear_message(tmp_path, capsys, main_env, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main([*tiny_flags(tmp_path), *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash-train: error: ") and message in err and "Traceback" not in err


def test_config_file_and_unknown_keys(tmp_path, capsys, main_env):
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = 3\nblock-sise = 4\n")
    with pytest.raises(SystemExit):
        main(["--config", str(bad)])
    assert "unknown setting 'block_sise'" in capsys.readouterr().err
    wrong_type = tmp_path / "wrong.yaml"
    wrong_type.write_text("steps: three\n")
    with pytest.raises(SystemExit):
        main(["--config", str(wrong_type)])
    assert "'steps' must be int" in capsys.readouterr().err


def test_export_command_bad_input_gets_one_clear_message(tmp_path, capsys, main_env):
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(tmp_path / "no-run"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("dflash-train export: error: ") and "Traceback" not in err
    assert f"RUN_DIR {tmp_path / 'no-run'} does not exist" in err and not (tmp_path / "out").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        main(["export", str(tmp_path / "empty"), str(tmp_path / "out")])
    assert "no checkpoint.safetensors" in capsys.readouterr().err and not (tmp_path / "out").exists()


# --- the run folder: never lost, resumed with its own settings (issue 28) ---------------------------------


def test_a_run_is_never_replaced_unasked_and_resumes_with_its_settings(tmp_path):
    flags = [*tiny_flags(tmp_path), "--no-compile", "--eval-prompts", "0", "--steps", "3"]
    out = tmp_path / "run"
    assert run_cli(flags).returncode == 0
    saved = {name: (out / name).read_bytes() for name in ("checkpoint.safetensors", "metrics.jsonl")}
    from dflash_train.config import read_config_file

    settings = read_config_file(str(out / "config.toml"))  # readable, and a --config file
    assert settings["steps"] == 3 and settings["seq_len"] == 48 and "resume" not in settings
    again = run_cli(flags)
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert again.stderr == (
        f"dflash-train: error: --out-dir {out} holds a run: continue it with --resume, delete it with --overwrite, "
        "or give another --out-dir\n"
    )
    assert {name: (out / name).read_bytes() for name in saved} == saved
    # A bare --resume and one change: the run goes on with its own settings, the change named.
    resumed = run_cli(["--resume", "--out-dir", str(out), "--steps", "5"])
    assert resumed.returncode == 0, resumed.stderr
    assert "from step 3 with its settings" in resumed.stdout and "changed: --steps 3 -> 5 (so it" in resumed.stdout
    assert "done: 5 steps" in resumed.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["type"] == "train"] == [1, 2, 3, 4, 5]
    assert read_config_file(str(out / "config.toml"))["steps"] == 5
    replaced = run_cli([*flags, "--steps", "2", "--overwrite"])
    assert replaced.returncode == 0, replaced.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["type"] == "train"] == [1, 2]


# What `main` does with a mistake, in a fresh interpreter: its exit status, and whether torch was imported by then.
_MAIN_REPORTING_TORCH = """
import sys
{setup}
from dflash_train.__main__ import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print("torch imported" if "torch" in sys.modules else "torch not imported")
sys.exit(code)
"""


def run_main(args: list[str], setup: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _MAIN_REPORTING_TORCH.format(setup=setup), *args],
        capture_output=True, text=True, timeout=60, env=_env(), cwd=REPO,
    )  # fmt: skip


def test_mistakes_are_one_line_and_exit_2_before_torch_is_imported(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    # root writes in a mode-555 folder: there, a folder the kernel refuses to create in (sysfs)
    unwritable = "/sys/dflash-run" if os.geteuid() == 0 else str(read_only)
    run = str(tmp_path / "run")
    cases = [
        ([*tiny_flags(tmp_path), "--out-dir", str(a_file)], f"--out-dir {a_file} is a file, not a folder"),
        ([*tiny_flags(tmp_path), "--out-dir", f"{a_file}/run"], f"--out-dir {a_file}/run: {a_file} is a file, not a"),
        ([*tiny_flags(tmp_path), "--out-dir", unwritable], f"--out-dir {unwritable}: cannot "),
        ([*tiny_flags(tmp_path), "--export", str(a_file)], f"--export {a_file} is a file, not a folder"),
        ([*tiny_flags(tmp_path), "--cache-dir", str(a_file)], f"--cache-dir {a_file} is a file, not a folder"),
        ([*tiny_flags(tmp_path), "--steps", "0"], "--steps must be at least 1 (got 0)"),
        ([*tiny_flags(tmp_path), "--resume", "--overwrite"], "--resume continues the run in --out-dir and --overwr"),
        (["--resume", "--out-dir", run], f"--resume: no checkpoint at {run}/checkpoint.safetensors ({run} does not"),
        ([*tiny_flags(tmp_path), "--drafter-layers", "3"], "and the 5-layer target has 2 there: use --drafter-layers"),
        (["export", run, str(tmp_path / "out")], f"RUN_DIR {run} does not exist"),
        (["export", str(tmp_path), str(a_file)], f"OUT_DIR {a_file} is a file, not a folder"),
    ]
    # Folders that are not the run's to write in: another's files, a compile cache others can write, one in use.
    not_ours, busy, shared = tmp_path / "not-ours", tmp_path / "busy", tmp_path / "shared"
    for folder in (not_ours, busy, shared / "inductor"):
        folder.mkdir(parents=True)
    (not_ours / "NOTES.md").write_text("mine")
    (shared / "inductor").chmod(0o777)
    not_an_export = f"export folder {not_ours} holds files and is not an exported drafter"
    elsewhere = [*tiny_flags(tmp_path), "--out-dir", str(busy)]  # a run folder is made before the cache's check
    cases += [
        ([*tiny_flags(tmp_path), "--export", str(not_ours)], not_an_export),
        (["export", str(tmp_path), str(not_ours)], not_an_export),
        ([*elsewhere, "--cache-dir", str(shared)], f"compile cache {shared / 'inductor'} (TORCHINDUCTOR_CACHE_DIR) "),
    ]
    for args, message in cases:
        ran = run_main(args, setup="import os; os.environ.pop('TORCHINDUCTOR_CACHE_DIR', None)")
        assert ran.returncode == 2, (args, ran.stderr)
        assert len(ran.stderr.splitlines()) == 1 and message in ran.stderr, (args, ran.stderr)
        assert ran.stdout == "torch not imported\n", (args, ran.stdout)
    # Another run holds the folder (here, a lock of this process's own): so it is told, whatever its flags.
    held = f"from dflash_train.files import RunLock; lock = RunLock({str(busy)!r})"
    for flags in ([], ["--resume"]):
        ran = run_main([*elsewhere, *flags], setup=held)
        assert ran.returncode == 2 and f"error: --out-dir {busy} is in use by another run (process " in ran.stderr
        assert ran.stdout == "torch not imported\n", ran.stdout
    assert a_file.read_text() == "mine" and not (tmp_path / "run").exists() and not (tmp_path / "out").exists()
    assert (not_ours / "NOTES.md").read_text() == "mine" and os.listdir(not_ours) == ["NOTES.md"]
    helped = run_main(["--help"])
    assert helped.returncode == 0 and "python -m dflash_train export RUN_DIR OUT_DIR" in " ".join(helped.stdout.split())
    missing = run_main(tiny_flags(tmp_path), setup="sys.modules['tqdm'] = None  # as if it were not installed")
    assert missing.returncode == 2 and missing.stdout == "torch not imported\n"
    assert missing.stderr == (
        "dflash-train: error: the trainer needs the 'train' extra, which is not installed (no tqdm): "
        "pip install -e '.[train]' in a checkout of torchfix\n"
    )


def test_the_trainer_leaves_with_its_status_after_the_at_exit_handlers_and_waits_for_a_running_thread():
    # `python -m dflash_train` ends with leave(): no interpreter teardown, but what sys.exit would do before it.
    code = """
import atexit, sys, threading, time
from dflash_train.__main__ import leave
atexit.register(print, "at exit")
if sys.argv[1] == "thread":
    threading.Thread(target=lambda: (time.sleep(0.5), print("thread done"))).start()
print("buffered", end=" ")
leave(3)
"""
    for case, stdout in (("alone", "buffered at exit\n"), ("thread", "buffered thread done\nat exit\n")):
        ran = subprocess.run([sys.executable, "-c", code, case], capture_output=True, text=True, timeout=60)
        assert (ran.returncode, ran.stdout, ran.stderr) == (3, stdout, ""), case
