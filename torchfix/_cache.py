"""What ``import torchfix`` computes from torch's files, kept between processes.

Patching parses each edited torch file, works out the edits and compiles the edited file: most of the
import's cost, and the same every start. ``cached`` keeps such results in files under
``$TORCHFIX_CACHE_DIR`` (default ``$XDG_CACHE_HOME/torchfix``, else ``~/.cache/torchfix``);
``TORCHFIX_CACHE=0`` turns it off.

A cached code object is code that will run, so:

* an entry's key holds everything its value depends on: the torch file's content hash (callers put it
  in), the hash of torchfix's own source files (any change of torchfix, installed or edited, misses),
  Python's bytecode magic number and the interpreter's version;
* an entry stores its whole key and is used only when that key matches, so a truncated, corrupted or
  foreign file is recomputed and rewritten, never trusted;
* the directory is made 0700 and used only when it belongs to this user and nobody else can write it
  (nor the entry), else the cache is refused with one warning;
* entries are written to a temporary file and renamed into place, so processes starting together
  (torchrun) never read a half-written entry; where the directory cannot be written (a read-only
  install, a full disk) entries are computed and not stored, silently.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import marshal
import os
import stat
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

_FORMAT = 2  # bump when what an entry holds changes shape


def digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


@functools.cache
def _torchfix_digest() -> str:
    """The hash of every torchfix source file: a cached result never outlives the code that made it."""
    package = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def _directory() -> Path | None:
    """The cache directory, made if needed; None where the cache is off or refused."""
    if os.environ.get("TORCHFIX_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    base = os.environ.get("TORCHFIX_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "torchfix"
    )
    path = Path(base)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
    except OSError:
        return None  # cannot even make it: run without a cache
    if _unsafe(info):
        warnings.warn(
            f"torchfix: not using the cache directory {path}: it must belong to you and be writable by you "
            "only (chmod 700); set TORCHFIX_CACHE_DIR to another, or TORCHFIX_CACHE=0",
            stacklevel=2,
        )
        return None
    return path


def _unsafe(info: os.stat_result) -> bool:
    owner = info.st_uid != os.getuid() if hasattr(os, "getuid") else False
    return owner or bool(info.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def cached(kind: str, key: tuple[str, ...], compute: Callable[[], T]) -> T:
    """``compute()``, or the value an earlier process stored for (``kind``, ``key``). Values must be
    marshal-able (code objects, tuples, lists, dicts, strings, numbers, None)."""
    directory = _directory()
    if directory is None:
        return compute()
    full_key = (_FORMAT, kind, *key, _torchfix_digest(), importlib.util.MAGIC_NUMBER.hex(), sys.version)
    path = directory / f"{kind}-{digest(*map(str, full_key))}.bin"
    try:
        with open(path, "rb") as f:
            if not _unsafe(os.fstat(f.fileno())):
                stored_key, value = marshal.loads(f.read())
                if stored_key == full_key:
                    return value
    except (OSError, ValueError, EOFError, TypeError):
        pass  # absent, unreadable or corrupted: compute it again
    value = compute()
    _store(directory, path, marshal.dumps((full_key, value)))
    return value


def _store(directory: Path, path: Path, data: bytes) -> None:
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")  # 0600
    except OSError:
        return  # a read-only directory: computed, not stored
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
