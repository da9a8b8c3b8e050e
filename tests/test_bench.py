"""The benchmarks run (tiny sizes). They measure; they assert nothing about speed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXES

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["overhead", "coldstart", "firststep", "trainer"])
def test_benchmark_smoke(name, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench", name, "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        # The trainer's runs keep their folders (a benchmark's outputs): here, in the test's own folder.
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr
    assert f"== {name}" in proc.stdout
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["torch"]
    # Every configuration ran (a failed one is reported, not raised).
    assert not [row for row in result.get("rows", []) if "error" in row], result
    if name == "overhead":
        # Counted, not timed: torchfix adds no call to a compiled call, only its fast reads of moved globals: a
        # flag's is one instruction more (an attribute read, on Python 3.11 and 3.12 alike), an attribute of the
        # compile stance none; torch 2.13 reads is_exporting() four times per call and is_fx_symbolic_tracing()
        # once (5). A compiled module's call also reads and writes its per-thread "in a compiled module" flag, a
        # threading.local: 3 more (8).
        for key, most in (("compiled_call_work", 10), ("compiled_module_call_work", 10)):
            work = result[key]
            assert work["calls_with_torchfix"] == work["calls_without_torchfix"], (key, work)
            assert 0 <= work["opcodes_with_torchfix"] - work["opcodes_without_torchfix"] <= most, (key, work)


def test_trainer_rows_with_cuda_graphs_on_cuda_only():
    from bench import trainer

    assert trainer.configurations("cpu", (1, 2)) == [
        ("threads", 1, "default", "per-thread"),
        ("threads", 2, "default", "per-thread"),
        ("lock", 2, "default", "per-thread"),
        ("processes", 2, "default", "per-thread"),
    ]
    cuda = trainer.configurations("cuda:0", (1, 2, 3))
    cg = [(way, n) for way, n, mode, streams in cuda if mode == "reduce-overhead" and streams == "per-thread"]
    assert cg == [("threads", 1), ("threads", 2), ("threads", 3), ("processes", 3)]
    # One drafter thread (with its target thread) on one shared stream too, in both modes.
    shared = [(n, mode) for way, n, mode, streams in cuda if streams == "shared"]
    assert shared == [(1, "default"), (1, "reduce-overhead")]
    row = dict(replicas=3, tokens_per_s=1000.0, all_first_steps_s=1.0, cuda_peak_gib=0.1, host_rss_gib=1.0)
    row |= dict(unique_graphs=3, eager_fallback=False, cudagraph_skips=0)
    result = dict(torch="2.13.0", device="cuda:0", steps=4, global_batch=12, seq_len=256)
    result["rows"] = [
        row | dict(mode="threads", compile_mode="default"),
        row | dict(mode="threads+cg", compile_mode="reduce-overhead", vs_threads=1.5, mfu=0.374),
        row | dict(mode="processes+cg", compile_mode="reduce-overhead", vs_threads=2.0, cudagraph_skips=2),
    ]
    lines = trainer.table(result).splitlines()
    assert lines[1].startswith("+cg: --compile-mode reduce-overhead")
    assert lines[3].startswith("threads+cg      x3:") and "(x1.50 threads), MFU 37.4%," in lines[3]
    assert lines[4].startswith("processes+cg    x3:") and lines[4].endswith("CUDA GRAPHS SKIPPED 2 TIMES")


def test_real_target_builds_a_model_the_trainer_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    from bench import real_target
    from dflash_train.data import HFTokenizer

    out = real_target.build(tmp_path / "target", shape="cpu")
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert sum(p.numel() for p in model.parameters()) == real_target.parameters("cpu")
    assert model.config.vocab_size == real_target.VOCAB
    tokenizer = HFTokenizer(str(out), model.config.vocab_size)
    # DFlash's mask token and EOS are the tokenizer's own: no embedding row is added.
    assert tokenizer.mask_token_id < real_target.VOCAB and tokenizer.eos_token_id != tokenizer.mask_token_id
    text = "def step(x):\n    return x * 2  # é\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text  # byte-level: every input round-trips
    weights = (out / "model.safetensors").stat().st_mtime_ns
    assert real_target.build(out, shape="cpu") == out and (out / "model.safetensors").stat().st_mtime_ns == weights
    assert real_target.parameters("gpu") == 838_932_480  # the shape the GPU benchmarks name "839 M"


def test_cost_profile_diff_per_step():
    from bench.cost import STEP_MARKER, profile_diff, table

    def op(name: str, calls: int, cpu: float) -> dict:
        return {"op": name, "calls": calls, "self_cpu_us": cpu, "self_device_us": 0.0}

    # Per optimizer step (the window of "on" held 2, that of "off" 4, whatever steps were asked for).
    on = {"steps": 3, "ops": [op("aten::mm", 8, 400.0), op("aten::copy_", 4, 100.0), op(STEP_MARKER, 2, 0.0)]}
    off = {"steps": 3, "ops": [op("aten::mm", 16, 400.0), op("aten::view", 5, 0.0), op(STEP_MARKER, 4, 0.0)]}
    diff = profile_diff(on, off)
    assert diff["time"] == "self CPU time" and diff["total_us_per_step"] == [250.0, 100.0]
    # aten::copy_: 2 calls a step against none; aten::view: none against 1.25
    assert [r["op"] for r in diff["calls_differ"]] == ["aten::copy_", "aten::view"]
    assert diff["largest_time_differences"][0] == {"op": "aten::mm", "calls": [4.0, 4.0], "self_us": [200.0, 100.0]}
    result = dict(torch="2.13.0", device="cpu", target_parameters=1e7, steps=4, global_batch=2, seq_len=64)
    retried = {"disabled": "1", "failed_attempts": ["RuntimeError: H1"], "tokens_per_s": 1.0}  # then it ran
    result |= dict(warmups=[{"disabled": "", "failed_attempts": []}], runs=[retried], on_tokens_per_s=[])
    result |= dict(off_tokens_per_s=[1.0], ratio_of_medians=None, profile=diff)
    text = table(result)
    assert "profile, self CPU time per step: 0.25 ms with torchfix, 0.10 ms without" in text
    assert "a run failed and was tried again (TORCHFIX_DISABLE='1'): RuntimeError: H1" in text
    assert "a run failed (" not in text


def test_cost_ledger_resumes_and_refuses_another_shape(tmp_path):
    from bench.cost import _Ledger

    path = tmp_path / "runs.jsonl"
    ledger = _Ledger(path, ("cuda:0", 40, 12))
    ledger.record("pair 0 run 0 on", {"tokens_per_s": 1.0})
    with path.open("a") as f:
        f.write('{"slot": "pair 0 run 1 off", "sha')  # what a run killed mid-write leaves
    resumed = _Ledger(path, ("cuda:0", 40, 12))
    assert "pair 0 run 0 on" in resumed and "pair 0 run 1 off" not in resumed
    assert resumed["pair 0 run 0 on"] == {"tokens_per_s": 1.0}
    resumed.record("pair 0 run 1 off", {"tokens_per_s": 2.0})
    assert _Ledger(path, ("cuda:0", 40, 12))["pair 0 run 1 off"] == {"tokens_per_s": 2.0}
    with pytest.raises(SystemExit, match="another shape"):
        _Ledger(path, ("cpu", 12, 6))


def test_cost_runs_disabled_only_the_fixes_a_run_applied():
    from bench.cost import fixes_to_disable

    known = ["a", "b", "c"]
    on = {"disabled": "", "applied_fixes": ["a", "c"]}
    off = {"disabled": "1", "applied_fixes": []}
    assert fixes_to_disable(known, [on, off, on | {"applied_fixes": ["c"]}]) == (["a", "c"], ["b"])
    # Runs of an older ledger did not record them: every fix is run disabled.
    assert fixes_to_disable(known, [{"disabled": ""}, off]) == (known, [])


def test_cost_refuses_a_fix_name_it_does_not_know_before_any_run(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "cost", "--quick", "--fixes", "fx-tracing-flag,no-such-fix", "--out", tmp_path],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "no fix named no-such-fix" in proc.stderr, proc.stderr
    assert not (tmp_path / "cost-state" / "runs.jsonl").exists()


def test_one_thread_sees_torch_as_without_torchfix(tmp_path):
    """The equivalence run, short form: every 25th operator of torch's OpInfo database through torch.compile
    (aot_eager) and make_fx, and every API case, with torchfix and without; no difference in outputs, graphs, graph
    breaks, recompiles or errors (``python -m bench equivalence`` runs all the operators), and every fix's patched
    code among what the cases ran."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "equivalence", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "equivalence.json").read_text())
    assert result["operators"] > 20 and result["graphs"] > 10, result
    assert result["differences"] == {}, proc.stdout
    # Each fix applied on this torch ran its patched code in some API case (measured with a profiler), but the fixes
    # whose code runs only with CUDA, on a machine without it. A fix with no code of its own (a config default)
    # and a fix this torch does not need are not in fixes_with_patched_code.
    ran = {name for names in result["api_fixes_run"].values() for name in names}
    not_run = set(result["fixes_with_patched_code"]) - ran
    cuda_only = set() if "cuda_graphs" in result["api_cases"] else {fix["name"] for fix in FIXES if fix["needs_cuda"]}
    assert not_run == cuda_only & set(result["fixes_with_patched_code"]), (not_run, cuda_only)
    # Measured at all (a run that mapped no code would pass above): every fix of this torch's releases has patched
    # code here, but at most two (one this torch does not need, one that changes a config default: 2.13).
    supported = [fix["name"] for fix in FIXES if fix["supported"]]
    assert len(result["fixes_with_patched_code"]) >= len(supported) - 2, (supported, result["fixes_with_patched_code"])


def test_the_workers_in_turns_count_a_step_and_tell_where_the_instructions_go():
    """The protocol of ``bench overhead``'s workers timed in turns, with a step of plain Python (no torch): the ready
    line's calls, instructions (-1 before Python 3.12) and instructions by function, then a rate for each request."""
    from bench.overhead import TURNS_TAIL, added_by_function

    step = "import os, sys, time\ndef step():\n    return sorted(range(5))\nsync = lambda: None\n"
    proc = subprocess.run(
        [sys.executable, "-c", step + TURNS_TAIL], input="10\n", capture_output=True, text=True, timeout=60
    )
    ready, rate = proc.stdout.splitlines()
    word, calls, instructions, by_function = ready.split(maxsplit=3)
    assert word == "ready" and float(calls) >= 1 and float(rate.split()[0]) > 0, proc.stdout
    by_function = json.loads(by_function)
    if sys.version_info >= (3, 12):
        assert float(instructions) == pytest.approx(sum(by_function.values())) and "<string>:step" in by_function
    else:
        assert instructions == "-1" and by_function == {}
    assert added_by_function({"a": 10, "b": 1.2, "c": 3}, {"a": 4, "b": 1.0, "d": 2}) == {"a": 6, "c": 3, "d": -2}


def test_instructions_reads_the_count_of_the_window_it_switched_on():
    from bench.instructions import total

    # As callgrind writes it with --instr-atstart=no: the summary of the whole run first (0), then the window's.
    assert total("version: 1\nevents: Ir\nsummary: 0\nfn=(1) main\n3 5\ntotals: 152099020\n") == 152099020
    with pytest.raises(RuntimeError, match="no instruction total"):
        total("events: Ir\nsummary: 0\n")


def test_help_names_the_benchmarks_and_an_unknown_one_is_refused():
    def bench(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "bench", *args], cwd=REPO, capture_output=True, text=True)

    helped = bench("--help")
    assert helped.returncode == 0 and "[NAME ...]" in helped.stdout and "{[]" not in helped.stdout
    listed = "overhead, coldstart, firststep, trainer, cudagraphs, cost, equivalence, instructions (default: all)"
    assert listed in " ".join(helped.stdout.split())
    refused = bench("nope")
    assert refused.returncode == 2 and "unknown benchmark nope: choose from overhead," in refused.stderr
