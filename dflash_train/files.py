"""The trainer's files on disk, kept safe from a kill, a full disk, a second run and other users.

* ``save_safetensors``, ``replace_text``: a file replaced whole or not at all, on disk (fsynced) before it takes
  the old one's place; a full disk is one line (``OutOfSpace``), not a write error in a worker's traceback;
* ``RunLock``: one run at a time in an --out-dir (``check_not_in_use`` looks before torch is imported), and
  ``remove_leftovers`` of the saves a kill cut short there;
* ``private_compile_caches``: Inductor's (and Triton's) compiled code in a folder only this user can write.

This module must not import torch: ``__main__`` sets the compile caches up *before* torch is imported.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config import ConfigError

TMP_SUFFIX = ".dflash-tmp"
# What safetensors' save_file writes before renaming it to the name asked for (Rust's tempfile crate).
SAFETENSORS_TMP = re.compile(r"^\.tmp[A-Za-z0-9]{6}$")
LOCK_NAME = ".dflash_train.lock"


class OutOfSpace(Exception):
    """A save that did not fit on its filesystem: one line, naming the folder and the space it needs."""


def save_safetensors(path: Path, tensors: Mapping[str, Any], metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` to ``path`` so that a kill (or a power cut) at any moment leaves the old file or the
    new one, whole: into a temporary file beside it, fsynced, renamed over ``path``, and the rename fsynced."""
    from safetensors.torch import save_file  # imports torch

    path = Path(path)
    tmp = _tmp_name(path)
    # The tensors, their header (about a hundred bytes each) and the metadata.
    needed = sum(t.nbytes for t in tensors.values()) + 128 * len(tensors) + len(json.dumps(metadata or {}))
    try:
        save_file(dict(tensors), str(tmp), metadata=metadata)
        _fsync(tmp)
    except Exception as e:  # safetensors reports a full disk as its own error, the OS error in its text
        free = _free_bytes(path.parent)
        if (
            free >= needed
            and getattr(e, "errno", None) not in (errno.ENOSPC, errno.EDQUOT)
            and "os error 28" not in str(e)
        ):
            raise
        tmp.unlink(missing_ok=True)
        raise OutOfSpace(
            f"no space left to save {path.name} in {path.parent}: it needs {needed / 1e6:.1f} MB, "
            f"{free / 1e6:.1f} MB are free there",
        ) from e
    _move_into_place(tmp, path)


def replace_text(path: Path, text: str) -> None:
    """``path`` replaced by ``text`` as ``save_safetensors`` replaces a file: whole or not at all."""
    tmp = _tmp_name(path)
    tmp.write_text(text)
    _fsync(tmp)
    _move_into_place(tmp, path)


def _tmp_name(path: Path) -> Path:
    # The process's own: two runs may fill one cache at once.
    return path.with_name(f"{path.name}.{os.getpid()}{TMP_SUFFIX}")


def _move_into_place(tmp: Path, path: Path) -> None:
    """Rename the written and fsynced ``tmp`` over ``path``, and fsync the rename. Fsynced before the rename:
    else a crash can leave the new name on a file whose data never reached the disk."""
    os.replace(tmp, path)
    _fsync(path.parent)


def _free_bytes(folder: Path) -> int:
    found = os.statvfs(folder)
    return found.f_bavail * found.f_frsize


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_leftovers(folder: Path) -> list[str]:
    """Delete what saves into ``folder`` that a kill cut short left there (``save_safetensors``' temporary
    file and safetensors' own); return their names. Only while holding the folder's RunLock: no save of
    another run can be under way."""
    removed = []
    for entry in Path(folder).iterdir():
        if entry.is_file() and (entry.name.endswith(TMP_SUFFIX) or SAFETENSORS_TMP.match(entry.name)):
            entry.unlink()
            removed.append(entry.name)
    return sorted(removed)


def _lock(fd: int, folder: Path) -> None:
    """Take the exclusive lock on ``fd``, ``folder``'s lock file, or close it and raise ConfigError naming the run
    that holds it (its process id is the file's text)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ConfigError(
            f"--out-dir {folder} is in use by another run (process {holder}): wait for it to end or give "
            "another --out-dir"
        ) from None


def check_not_in_use(folder: Path) -> None:
    """Raise RunLock's ConfigError if another run holds ``folder``'s lock now: a cheap look before torch is
    imported, so that a second run is told so whatever its flags. Writes nothing; RunLock takes the lock."""
    try:
        fd = os.open(Path(folder) / LOCK_NAME, os.O_RDONLY)
    except OSError:  # no lock file (no run was ever there) or none readable: RunLock tells later
        return
    _lock(fd, folder)
    os.close(fd)  # releases it at once


class RunLock:
    """An exclusive lock on ``folder`` for the life of this run (``fcntl.flock`` on a file in it, which the
    system releases when the process ends, even by SIGKILL): a second run there stops with ConfigError."""

    def __init__(self, folder: Path) -> None:
        self._fd = os.open(Path(folder) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        _lock(self._fd, folder)
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None


# --- torch.compile's caches -------------------------------------------------------------------------

# Inductor writes generated code there and imports it; Triton's cache is inside it unless TRITON_CACHE_DIR is set.
COMPILE_CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def private_compile_caches(cache_dir: str) -> None:
    """Point Inductor at ``cache_dir``/inductor, made 0700, unless TORCHINDUCTOR_CACHE_DIR is set; check that
    no other user owns or can write that folder or TRITON_CACHE_DIR's (raise ConfigError).

    Inductor's default, /tmp/torchinductor_$USER, is taken as it is found: a folder another user made there
    first would let them swap the code this process compiles and runs (torch issue 121122). Call before
    torch is imported."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(cache_dir).expanduser().absolute() / "inductor"))
    for variable in COMPILE_CACHE_VARIABLES:
        if variable in os.environ:
            _check_private(Path(os.environ[variable]), variable)


def _check_private(folder: Path, variable: str) -> None:
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        info, link = folder.stat(), folder.lstat()  # a symbolic link's owner could point it elsewhere
    except OSError as e:
        raise ConfigError(f"compile cache {folder} ({variable}): {e.strerror}") from e
    owner = next((uid for uid in (link.st_uid, info.st_uid) if uid != os.geteuid()), None)
    if owner is not None:
        problem = f"is owned by another user (uid {owner})"
    elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = f"can be written by other users (mode {stat.filemode(info.st_mode)})"
    else:
        return
    raise ConfigError(
        f"compile cache {folder} ({variable}) {problem}: they could swap the code torch compiles and runs; "
        f"remove it, or set {variable} to a folder of yours that only you can write"
    )
