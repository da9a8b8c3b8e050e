"""The cache of what ``import torchfix`` computes from torch's files (``torchfix._cache``): a warm start
patches exactly as a cold one, and a bad entry or an unsafe directory is never trusted."""

import os
import stat
import subprocess
import sys

import pytest
from conftest import run_ok

# What the patching left in torch: every fix's state and the code swapped into every patched function.
PROBE = """
import hashlib, json, types
import torch, torchfix
from torchfix.__main__ import _load_triggers
from torchfix._source import PatchedFile, iter_code

_load_triggers()  # the fixes waiting for Dynamo or Inductor (where this torch has them)

def const(value):  # constants as text that does not change between processes (no addresses, sets sorted)
    if isinstance(value, types.CodeType):
        return "code"
    if isinstance(value, frozenset):
        return repr(sorted(map(repr, value)))
    return repr(value)

codes = {
    name: hashlib.sha256(repr(sorted(
        (c.co_filename, c.co_firstlineno, c.co_name, c.co_code, [const(k) for k in c.co_consts])
        for top in f.installed.values() for c in iter_code(top)
    )).encode()).hexdigest()
    for name, f in PatchedFile._files.items()
}
print(json.dumps({"status": [f"{s.name}: {s.state.value}" for s in torchfix.status()], "codes": codes}))
"""


def probe(cache, **env) -> dict:
    return run_ok(PROBE, env={"TORCHFIX_CACHE_DIR": str(cache), **env}, forked="triggers").json()


def entries(cache) -> list:
    return sorted(p for p in cache.iterdir() if p.is_file())


# How the cache keys, writes and guards its entries is the same on every torch; what it stores is not (the
# warm-start test, which the matrix runs).
release_independent = pytest.mark.release_independent


def test_a_warm_start_patches_as_a_cold_one(tmp_path):
    cache = tmp_path / "cache"
    cold = probe(cache)
    assert entries(cache), "the cold start stored nothing"
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in entries(cache))
    stored = {p: p.stat().st_mtime_ns for p in entries(cache)}
    warm = probe(cache)
    assert warm == cold == probe(cache, TORCHFIX_CACHE="0")
    assert cold["codes"], cold
    assert {p: p.stat().st_mtime_ns for p in entries(cache)} == stored  # read, not rewritten


@release_independent
def test_corrupted_entries_are_rebuilt_not_trusted(tmp_path):
    cache = tmp_path / "cache"
    cold = probe(cache)
    for i, path in enumerate(entries(cache)):
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2] if i % 2 else b"\0garbage" * 7)
    assert probe(cache) == cold
    import marshal

    for path in entries(cache):
        marshal.loads(path.read_bytes())  # every entry whole again


@release_independent
def test_an_entry_is_used_only_for_its_own_key(tmp_path, monkeypatch):
    from torchfix import _cache

    monkeypatch.setenv("TORCHFIX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHFIX_CACHE", raising=False)
    _cache._directory.cache_clear()
    try:
        assert _cache.cached("test", ("a",), lambda: "value of a") == "value of a"
        assert _cache.cached("test", ("a",), lambda: "recomputed") == "value of a"
        (entry_a,) = entries(tmp_path)
        assert _cache.cached("test", ("b",), lambda: "value of b") == "value of b"
        (entry_b,) = (p for p in entries(tmp_path) if p != entry_a)
        entry_b.write_bytes(entry_a.read_bytes())  # a's entry under b's name
        assert _cache.cached("test", ("b",), lambda: "b again") == "b again"
    finally:
        _cache._directory.cache_clear()


@release_independent
def test_a_directory_others_can_write_is_refused(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    ran = run_ok(PROBE, env={"TORCHFIX_CACHE_DIR": str(cache)}, forked="triggers")
    assert "not using the cache directory" in ran.stderr, ran.stderr
    assert ran.json() == probe(tmp_path / "safe")
    assert entries(cache) == []


@release_independent
def test_the_cache_can_be_turned_off(tmp_path):
    probe(tmp_path / "cache", TORCHFIX_CACHE="0")
    assert not (tmp_path / "cache").exists()


@release_independent
def test_processes_starting_together_share_an_empty_cache(tmp_path):
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFIX_")}
    env.update(TORCHFIX_CACHE_DIR=str(cache), TORCHINDUCTOR_COMPILE_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, "-c", PROBE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        for _ in range(4)
    ]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0] * 4, [err[-2000:] for _, err in outputs]
    assert len({out.strip().splitlines()[-1] for out, _ in outputs}) == 1
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]
    assert probe(cache) == probe(tmp_path / "other")
