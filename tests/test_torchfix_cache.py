"""The cache of what ``import torchfix`` computes from torch's files (``torchfix.patching.cache``): a warm start
patches exactly as a cold one, and a bad entry or an unsafe directory is never trusted."""

import ast
import json
import marshal
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
from conftest import run_ok, run_python

# What the patching left in torch: every fix's state and the code swapped into every patched function.
PROBE = """
import hashlib, json, types
import torch, torchfix
from torchfix.__main__ import _load_triggers
from torchfix.patching.source import PatchedFile, iter_code

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


def entries(cache, kind: str = "") -> list:
    """The cache's entries (of ``kind`` only, where given: LOOKUP's are "test"; ``import torchfix`` stores its roster
    of fixes, "fixes", besides)."""
    return sorted(p for p in cache.iterdir() if p.is_file() and p.name.startswith(f"{kind}-" if kind else ""))


# How the cache keys, writes and guards its entries is the same on every torch; what it stores is not (the
# warm-start test, which the matrix runs).
release_independent = pytest.mark.release_independent
# One worker runs this file: its cold start (the fixture below) is made once, and every start is compared with it.
pytestmark = pytest.mark.xdist_group("cache")


@pytest.fixture(scope="module")
def cold_cache(tmp_path_factory):
    """A cache filled by one `import torchfix`, and what that import patched: what every start, warm, rebuilt or
    without a cache, must patch too. (A cold start parses and compiles every patched torch file: ~6 s here, so made
    once.)"""
    cache = tmp_path_factory.mktemp("cold") / "cache"
    return cache, probe(cache)


def copied(cold_cache, tmp_path) -> Path:
    cache = tmp_path / "cache"
    shutil.copytree(cold_cache[0], cache)  # modes and modification times kept
    return cache


def test_a_warm_start_patches_as_a_cold_one(cold_cache, tmp_path):
    cache, cold = copied(cold_cache, tmp_path), cold_cache[1]
    assert entries(cache), "the cold start stored nothing"
    assert stat.S_IMODE(cold_cache[0].stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in entries(cache))
    stored = {p: p.stat().st_mtime_ns for p in entries(cache)}
    assert probe(cache) == cold
    assert cold["codes"], cold
    assert {p: p.stat().st_mtime_ns for p in entries(cache)} == stored  # read, not rewritten


@release_independent
def test_corrupted_entries_are_rebuilt_not_trusted(cold_cache, tmp_path):
    cache = copied(cold_cache, tmp_path)
    for i, path in enumerate(entries(cache)):
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2] if i % 2 else b"\0garbage" * 7)
    assert probe(cache) == cold_cache[1]
    for path in entries(cache):
        marshal.loads(path.read_bytes())  # every entry whole again


@release_independent
def test_an_entry_is_used_only_for_its_own_key(tmp_path, monkeypatch):
    from torchfix.patching import cache as _cache

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
def test_a_directory_others_can_write_is_refused(cold_cache, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    ran = run_ok(PROBE, env={"TORCHFIX_CACHE_DIR": str(cache)}, forked="triggers")
    assert "not using the cache directory" in ran.stderr, ran.stderr
    assert ran.json() == cold_cache[1]
    assert entries(cache) == []


# Not release-independent: on each release, patching without the cache is patching with it (the warm-start test's
# other half).
def test_the_cache_can_be_turned_off(cold_cache, tmp_path):
    assert probe(tmp_path / "cache", TORCHFIX_CACHE="0") == cold_cache[1]
    assert not (tmp_path / "cache").exists()


@release_independent
def test_processes_starting_together_share_an_empty_cache(cold_cache, tmp_path):
    cache = tmp_path / "cache"
    # Four processes forked at once (from one that has imported torch and the triggers, not torchfix), each running
    # PROBE, and so `import torchfix`, against the empty cache; their parent exits 1 if one of them failed. Each
    # reports into a file of its own: a report is longer than a pipe's atomic write, so on one stdout they can mix.
    together = """
import os, sys
children = []
for child in range(4):
    if os.fork() == 0:
        sys.stdout = open(os.path.join(sys.argv[1], f"report-{child}.json"), "w")
        break
    children.append(None)
else:
    sys.exit(1 if any(os.wait()[1] for _ in children) else 0)
"""
    run_ok(
        together + PROBE, env={"TORCHFIX_CACHE_DIR": str(cache)}, forked="triggers", timeout=300, args=[str(tmp_path)]
    )
    reports = [json.loads(report.read_text()) for report in sorted(tmp_path.glob("report-*.json"))]
    assert reports == [cold_cache[1]] * 4, reports
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]
    assert probe(cache) == cold_cache[1]


# What someone else can leave where the cache looks (issue 32): a folder or an entry that is a symbolic link, the
# modes a `git clone` gives, a folder another user can swap, a relative path that makes a cloned repository's
# `.cache/torchfix` the cache, a named pipe, an entry that loads but does not apply, a `defaults` entry holding
# code. Most cases call the cache itself (LOOKUP: no torch import); a few go through `import torchfix`.
LOOKUP = """
import json, os, sys, warnings
os.chdir(sys.argv[1])
warnings.simplefilter("always")
from torchfix.patching import cache as _cache
{before}
print(json.dumps(_cache.cached("test", ("a",), lambda: "computed")))
"""


def lookup(env: dict, cwd=None, before: str = "", **kwargs):
    """LOOKUP in ``cwd``, running ``before`` first."""
    return run_python(LOOKUP.format(before=before), env=env, args=(str(cwd or os.getcwd()),), **kwargs)


def planted(tmp_path) -> tuple[str, bytes]:
    """The entry LOOKUP reads, with its own key and another value: what someone who can write the cache's folder
    (or ships one) leaves there."""
    made = tmp_path / "made"
    assert lookup({"TORCHFIX_CACHE_DIR": str(made)}).json() == "computed"
    (entry,) = entries(made, "test")
    key, _ = marshal.loads(entry.read_bytes())
    return entry.name, marshal.dumps((key, "planted"))


def tree(path, files: dict, folder_mode=0o700, file_mode=0o600):
    """A folder of files as a `git clone` leaves it (0755 and 0644 with umask 022; 0700 and 0600 with 077)."""
    path.mkdir(parents=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
        (path / name).chmod(file_mode)
    path.chmod(folder_mode)
    return path


def refused(ran, why: str) -> None:
    """The lookup computed its value, and said ``why`` once."""
    assert ran.returncode == 0, ran.stderr
    assert ran.json() == "computed", ran.stderr
    assert ran.stderr.count("TorchfixWarning") == 1 and why in ran.stderr, ran.stderr


@release_independent
def test_a_cache_folder_that_is_a_symlink_is_refused(tmp_path):
    name, data = planted(tmp_path)
    link = tmp_path / "cache"
    link.symlink_to(tree(tmp_path / "clone", {name: data}))
    refused(lookup({"TORCHFIX_CACHE_DIR": str(link)}), "is a symbolic link")


@release_independent
def test_an_entry_that_is_a_symlink_is_replaced(tmp_path):
    name, data = planted(tmp_path)
    clone = tree(tmp_path / "clone", {name: data})
    cache = tree(tmp_path / "cache", {})
    (cache / name).symlink_to(clone / name)
    refused(lookup({"TORCHFIX_CACHE_DIR": str(cache)}), "is a symbolic link")
    assert not (cache / name).is_symlink() and (clone / name).read_bytes() == data
    again = lookup({"TORCHFIX_CACHE_DIR": str(cache)})
    assert again.json() == "computed" and "TorchfixWarning" not in again.stderr, again.stderr


@release_independent
@pytest.mark.parametrize("what", ["folder", "entry"])
def test_modes_a_git_clone_gives_are_refused(tmp_path, what):
    name, data = planted(tmp_path)
    modes = {"folder": (0o755, 0o600), "entry": (0o700, 0o644)}[what]
    cache = tree(tmp_path / "cache", {name: data}, *modes)
    refused(lookup({"TORCHFIX_CACHE_DIR": str(cache)}), "0o755, not 0700" if what == "folder" else "0o644, not 0600")
    if what == "entry":  # replaced by one as torchfix writes them
        assert stat.S_IMODE((cache / name).stat().st_mode) == 0o600 and (cache / name).read_bytes() != data


def as_other_user(command: list[str]) -> None:
    """Run ``command`` as nobody (uid 65534): the other user of a shared machine."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to act as a second user")
    subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command], check=True, timeout=30)


@release_independent
def test_a_folder_in_a_folder_others_can_write_is_refused(tmp_path):
    name, data = planted(tmp_path)
    with tempfile.TemporaryDirectory() as top:  # where nobody can reach (tmp_path's parents are 0700)
        os.chmod(top, 0o755)
        shared = Path(top, "shared")
        shared.mkdir()
        shared.chmod(0o777)
        tree(shared / "cache", {})
        tree(shared / "clone", {name: data})  # another folder of yours there: a checkout, an older cache
        as_other_user(["sh", "-c", f"mv {shared}/cache {shared}/old && mv {shared}/clone {shared}/cache"])
        refused(lookup({"TORCHFIX_CACHE_DIR": str(shared / "cache")}), f"{shared} can be written by others")


def _own_group() -> bool:
    """Whether this user's group is theirs alone (a user private group, as Fedora and Debian make them)."""
    import grp
    import pwd

    you, group = pwd.getpwuid(os.getuid()), grp.getgrgid(os.getgid())
    return group.gr_name == you.pw_name and set(group.gr_mem) <= {you.pw_name}


@release_independent
@pytest.mark.parametrize("mode", [0o1777, 0o775], ids=["sticky", "own-group"])
def test_a_folder_in_a_sticky_or_own_group_folder_is_used(tmp_path, mode):
    """Where no one else can swap the folder: in /tmp-like folders, and in ~/.cache as umask 002 makes it."""
    if mode == 0o775 and not _own_group():
        pytest.skip("this user's group is not theirs alone")
    (tmp_path / "parent").mkdir()
    (tmp_path / "parent").chmod(mode)
    ran = lookup({"TORCHFIX_CACHE_DIR": str(tmp_path / "parent" / "cache")})
    assert ran.json() == "computed" and "TorchfixWarning" not in ran.stderr, ran.stderr
    assert len(entries(tmp_path / "parent" / "cache", "test")) == 1


@release_independent
def test_a_folder_swapped_after_the_check_is_not_read(tmp_path):
    name, data = planted(tmp_path)
    cache, clone = tree(tmp_path / "cache", {}), tree(tmp_path / "clone", {name: data})
    # The check, then someone else's rename of the folder, then the read.
    swap = f"_cache._directory()\nos.rename({str(cache)!r}, 'old')\nos.rename({str(clone)!r}, {str(cache)!r})"
    ran = lookup({"TORCHFIX_CACHE_DIR": str(cache)}, cwd=tmp_path, before=swap)
    assert ran.json() == "computed", ran.stderr
    assert [p.name for p in entries(tmp_path / "old", "test")] == [name]  # stored where the check looked


@release_independent
@pytest.mark.parametrize("variable", ["XDG_CACHE_HOME", "TORCHFIX_CACHE_DIR"])
def test_a_relative_cache_path_is_ignored(tmp_path, variable):
    name, data = planted(tmp_path)
    repo = tmp_path / "repo"  # a cloned repository shipping its cache
    tree(repo / ".cache" / "torchfix", {name: data})
    home, xdg = tmp_path / "home", tmp_path / "xdg"
    env = {"HOME": str(home), "XDG_CACHE_HOME": ".cache"}
    if variable == "TORCHFIX_CACHE_DIR":
        env.update(TORCHFIX_CACHE_DIR=".cache/torchfix", XDG_CACHE_HOME=str(xdg))
    refused(lookup(env, cwd=repo), f"{variable}='.cache")
    used = xdg / "torchfix" if variable == "TORCHFIX_CACHE_DIR" else home / ".cache" / "torchfix"
    assert [p.name for p in entries(used, "test")] == [name]


@release_independent
def test_an_entry_that_is_a_named_pipe_is_replaced(tmp_path):
    name, _ = planted(tmp_path)
    cache = tree(tmp_path / "cache", {})
    os.mkfifo(cache / name, 0o600)
    refused(lookup({"TORCHFIX_CACHE_DIR": str(cache)}, timeout=60), "is not a regular file")
    assert stat.S_ISREG((cache / name).lstat().st_mode)


@release_independent
@pytest.mark.parametrize("value", ["/tmp/x", "off"])
def test_the_cache_switch_takes_its_documented_values(tmp_path, value):
    ran = lookup({"TORCHFIX_CACHE": value, "TORCHFIX_CACHE_DIR": str(tmp_path / "cache")})
    if value == "off":
        assert ran.json() == "computed" and not (tmp_path / "cache").exists()
    else:  # not a documented value: the default (on), and one warning
        refused(ran, "TORCHFIX_CACHE='/tmp/x' is not")
        assert len(entries(tmp_path / "cache", "test")) == 1


def rewritten(cold_cache, tmp_path, kind: str, value_for) -> Path:
    """A copy of the cold cache whose ``kind`` entries hold ``value_for(key, value)`` under their own keys."""
    cache = copied(cold_cache, tmp_path)
    for path in cache.glob(f"{kind}-*.bin"):
        key, value = marshal.loads(path.read_bytes())
        path.write_bytes(marshal.dumps((key, value_for(key, value))))
    return cache


@release_independent
def test_a_defaults_entry_is_never_evaluated(cold_cache, tmp_path):
    marker = tmp_path / "PWNED"
    code = f"__import__('pathlib').Path({str(marker)!r}).write_text('PWNED') and None"
    # As torchfix wrote them before: name -> (the expression's text, its literal value, its kind).
    cache = rewritten(
        cold_cache, tmp_path, "defaults", lambda key, _: {n: (code, None, "object") for n in ast.literal_eval(key[3])}
    )
    ran = run_ok(PROBE, env={"TORCHFIX_CACHE_DIR": str(cache)}, forked="triggers")
    assert not marker.exists()
    assert ran.json() == cold_cache[1] and "not applied" not in ran.stderr, ran.stderr


@release_independent
def test_an_entry_that_does_not_apply_is_rebuilt(cold_cache, tmp_path):
    # Edits of lines the file does not have, under the right key.
    bad = lambda key, rows: [(10**6, *row[1:]) for row in rows]  # noqa: E731
    cache = rewritten(cold_cache, tmp_path, "edits", bad)
    ran = run_ok(PROBE, env={"TORCHFIX_CACHE_DIR": str(cache)}, forked="triggers")
    assert ran.json() == cold_cache[1] and "not applied" not in ran.stderr, ran.stderr
    for path in cache.glob("edits-*.bin"):  # replaced: the next start reads good ones
        assert all(row[0] < 10**6 for row in marshal.loads(path.read_bytes())[1])


@release_independent
def test_a_roster_of_fixes_that_misses_one_is_rebuilt(cold_cache, tmp_path):
    # The roster (each fix's module, name, order, trigger) says which fixes `import torchfix` installs: one that
    # lacks a fix, under the right key, must not leave it out.
    cache = rewritten(cold_cache, tmp_path, "fixes", lambda key, rows: rows[1:])
    ran = run_ok(PROBE, env={"TORCHFIX_CACHE_DIR": str(cache)}, forked="triggers")
    assert ran.json() == cold_cache[1], ran.stderr
    for path in cache.glob("fixes-*.bin"):  # replaced
        assert len(marshal.loads(path.read_bytes())[1]) == len(cold_cache[1]["status"])
