"""What ``import torchfix`` computes from torch's files, kept between processes.

Patching parses each edited torch file, works out the edits and compiles the edited file: most of the
import's cost, and the same every start. ``cached`` keeps such results in files under
``$TORCHFIX_CACHE_DIR`` (default ``$XDG_CACHE_HOME/torchfix``, else ``~/.cache/torchfix``; a relative path
is ignored, with a warning, as the XDG spec says); ``TORCHFIX_CACHE=0`` (or ``off``) turns it off, ``1``
(``on``, the default) on; another value is warned about and means on.

A cached code object is code that will run, so:

* an entry's key holds everything its value depends on: the torch file's content hash (callers put it
  in), the size and modification time of each of torchfix's own source files (any change of torchfix,
  installed or edited, misses: the test by which Python reuses a module's bytecode, so a change it missed
  would run stale torchfix code anyway), Python's bytecode magic number and the interpreter's version;
* an entry stores its whole key and is used only when that key matches, so a truncated, corrupted or
  foreign file is recomputed and rewritten, never trusted; one that loads but does not apply is
  rebuilt too (``rebuilt_on_failure``);
* the folder is opened one component at a time from ``/`` without following a symbolic link, and used
  only as that descriptor: no one can swap a part of it between the check and the use. It must be a
  folder of this user's with mode 0700, as torchfix makes it, in a folder no other user can change
  (see ``_unsafe_parent``); an entry must be a regular file of this user's with mode 0600, as torchfix
  writes them, else it is computed again and replaced. Either refusal says why, once;
* entries are written to a temporary file and renamed into place, so processes starting together
  (torchrun) never read a half-written entry; where the folder cannot be written (a read-only
  install, a full disk) entries are computed and not stored, silently.

Where a platform cannot open files relative to a folder's descriptor (Windows), there is no cache.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import importlib.util
import marshal
import os
import stat
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from .._errors import TorchfixWarning

T = TypeVar("T")

_FORMAT = 3  # bump when what an entry holds changes shape
_SWITCH_OFF, _SWITCH_ON = {"0", "off", "false", "no"}, {"", "1", "on", "true", "yes"}
# No symbolic link followed, a FIFO never waited on, nothing inherited by a program this process starts.
_FOLDER_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_ENTRY_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_SUPPORTED = os.open in os.supports_dir_fd and hasattr(os, "O_NOFOLLOW")
_MISSING = object()

# In this thread: .reads, how many entries were read; .fresh, whether rebuilt_on_failure's second attempt is under
# way (it reads none).
_attempt = threading.local()
_warned_entry = False


def digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


@functools.lru_cache(maxsize=64)
def text_digest(text: str) -> str:
    """``digest(text)`` of a torch file's text, which the patches of one file key several entries by: hashed once
    per string (a lookup hashes the string only the first time, and then compares it by identity)."""
    return digest(text)


@functools.cache
def _torchfix_digest() -> str:
    """The hash of every torchfix source file's name, size and modification time: a cached result never outlives
    the code that made it. (Reading and hashing their text cost 5 ms of each start on the CPU machine; this 1.)"""
    package = Path(__file__).resolve().parent.parent  # torchfix/, not this folder of it
    files = []
    for path in sorted(package.rglob("*.py")):
        info = path.stat()
        files.append(f"{path.relative_to(package)}:{info.st_size}:{info.st_mtime_ns}")
    return digest(*files)


def _warn(message: str) -> None:
    warnings.warn(f"torchfix: {message}", TorchfixWarning, stacklevel=3)


class _Refused(Exception):
    """The cache folder is not one torchfix can trust: the reason."""


@functools.cache
def _directory() -> int | None:
    """A descriptor of the cache folder (made if needed); None where the cache is off or refused."""
    switch = os.environ.get("TORCHFIX_CACHE", "").strip().lower()
    if switch in _SWITCH_OFF or not _SUPPORTED:
        return None
    if switch not in _SWITCH_ON:
        _warn(
            f"TORCHFIX_CACHE={os.environ['TORCHFIX_CACHE']!r} is not 1 or 0 (on or off): the cache stays on "
            "(TORCHFIX_CACHE_DIR names its folder)"
        )
    path = _location()
    if path is None:
        return None
    try:
        return _open_folder(path)
    except _Refused as refusal:
        _warn(
            f"not using the cache directory {path}: {refusal} (torchfix makes it a 0700 folder of yours in a "
            "folder only you can change); set TORCHFIX_CACHE_DIR to another, or TORCHFIX_CACHE=0"
        )
    except OSError:
        pass  # cannot even make it (a read-only home): run without a cache
    return None


def _location() -> str | None:
    """The cache folder's path: the first of these that is absolute (a relative one is warned about)."""
    candidates = [
        ("TORCHFIX_CACHE_DIR", os.environ.get("TORCHFIX_CACHE_DIR"), ""),
        ("XDG_CACHE_HOME", os.environ.get("XDG_CACHE_HOME"), "torchfix"),
        ("HOME", os.path.expanduser("~"), os.path.join(".cache", "torchfix")),  # HOME, else the password file
    ]
    for variable, base, below in candidates:
        if not base:
            continue
        if os.path.isabs(base):
            return os.path.normpath(os.path.join(base, below))
        _warn(f"{variable}={base!r} is ignored for the cache: it is not an absolute path")
    return None


def _open_folder(path: str) -> int:
    """A descriptor of the folder ``path``, made (0700) where absent: its parent's real path (symbolic links
    above the cache folder, such as a home on another disk, are resolved once) is opened one component at a
    time from ``/`` with no link followed, so what is checked is what is used."""
    parent, leaf = os.path.split(path)
    if not leaf:
        raise _Refused("it is the root folder")
    names = [name for name in os.path.realpath(parent).split(os.sep) if name] + [leaf]
    fd = os.open(os.sep, _FOLDER_FLAGS)
    chain = [(os.sep, os.fstat(fd))]
    try:
        for name in names:
            shown = os.path.join(chain[-1][0], name)
            child = _open_child(fd, name, shown)
            os.close(fd)
            fd = child
            chain.append((shown, os.fstat(fd)))
        folder = chain[-1][1]
        if folder.st_uid != os.getuid():
            raise _Refused("it does not belong to you")
        if stat.S_IMODE(folder.st_mode) != 0o700:
            raise _Refused(f"its mode is {oct(stat.S_IMODE(folder.st_mode))}, not 0700")
        reason = _unsafe_parent(chain[:-1])
        if reason:
            raise _Refused(reason)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_child(parent: int, name: str, shown: str) -> int:
    """The folder ``name`` in ``parent``, made where absent."""
    try:
        return os.open(name, _FOLDER_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        pass
    except PermissionError:
        raise _Refused(f"you cannot open {shown}") from None
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        is_link = stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
        raise _Refused(f"{shown} is {'a symbolic link' if is_link else 'not a folder'}") from None
    try:
        os.mkdir(name, 0o700, dir_fd=parent)  # where it cannot (a read-only home): OSError, no cache
    except FileExistsError:
        pass  # made by a process starting alongside
    fd = os.open(name, _FOLDER_FLAGS, dir_fd=parent)
    if os.fstat(fd).st_uid == os.getuid():
        os.fchmod(fd, 0o700)  # whatever the umask took away
    return fd


def _unsafe_parent(chain: list[tuple[str, os.stat_result]]) -> str | None:
    """Why someone else could swap the cache folder (by renaming it, or a folder above it), or None.

    Going up from the folder's parent: a folder of yours or root's that no one else can write ends the walk
    (above it, a rename could only put a folder that is not yours, which is refused, in its place); a sticky
    one (``/tmp``) lets no one rename what is not theirs, so the walk goes on up."""
    for shown, info in reversed(chain):
        if info.st_uid not in (os.getuid(), 0):
            return f"{shown} belongs to another user"
        if not _others_can_write(info):
            return None
        if not info.st_mode & stat.S_ISVTX:
            return f"{shown} can be written by others"
    return f"{os.sep} can be written by others"


def _others_can_write(info: os.stat_result) -> bool:
    if info.st_mode & stat.S_IWOTH:
        return True
    return bool(info.st_mode & stat.S_IWGRP) and not _group_of_yours_alone(info.st_gid)


@functools.cache
def _group_of_yours_alone(gid: int) -> bool:
    """Whether ``gid`` is your own group (a user private group, whose umask 002 makes folders group-writable:
    ``pip`` makes ``~/.cache`` so on Fedora)."""
    try:
        import grp
        import pwd

        you, group = pwd.getpwuid(os.getuid()), grp.getgrgid(gid)
    except (ImportError, KeyError):
        return False
    return gid == you.pw_gid and group.gr_name == you.pw_name and set(group.gr_mem) <= {you.pw_name}


def cached(kind: str, key: tuple[str, ...], compute: Callable[[], T]) -> T:
    """``compute()``, or the value an earlier process stored for (``kind``, ``key``). Values must be
    marshal-able (code objects, tuples, lists, dicts, strings, numbers, None)."""
    directory = _directory()
    if directory is None:
        return compute()
    full_key = (_FORMAT, kind, *key, _torchfix_digest(), importlib.util.MAGIC_NUMBER.hex(), sys.version)
    name = f"{kind}-{digest(*map(str, full_key))}.bin"
    if not getattr(_attempt, "fresh", False):
        value = _read(directory, name, full_key)
        if value is not _MISSING:
            _attempt.reads = getattr(_attempt, "reads", 0) + 1
            return value
    value = compute()
    _store(directory, name, marshal.dumps((full_key, value)))
    return value


def _read(directory: int, name: str, full_key: tuple) -> object:
    """The value stored under ``name`` for ``full_key``, or _MISSING where there is none to trust."""
    try:
        with open(name, "rb", opener=lambda path, _: os.open(path, _ENTRY_FLAGS, dir_fd=directory)) as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                _refuse_entry(name, "is not a regular file")
            elif info.st_uid != os.getuid():
                _refuse_entry(name, "does not belong to you")
            elif stat.S_IMODE(info.st_mode) != 0o600:
                _refuse_entry(name, f"has mode {oct(stat.S_IMODE(info.st_mode))}, not 0600")
            else:
                stored_key, value = marshal.loads(f.read())
                return value if stored_key == full_key else _MISSING
    except FileNotFoundError:
        pass
    except OSError as exc:
        _refuse_entry(name, "is a symbolic link" if exc.errno == errno.ELOOP else f"cannot be read ({exc})")
    except (ValueError, EOFError, TypeError):
        pass  # corrupted: computed again
    return _MISSING


def _refuse_entry(name: str, reason: str) -> None:
    global _warned_entry
    if not _warned_entry:
        _warned_entry = True
        _warn(f"the cache entry {name} {reason}: computed again and replaced (said once per process)")


def _store(directory: int, name: str, data: bytes) -> None:
    temporary = f".tmp-{os.urandom(8).hex()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(temporary, flags, 0o600, dir_fd=directory)
    except OSError:
        return  # a read-only folder: computed, not stored
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(fd, 0o600)  # whatever the umask took away
            f.write(data)
        os.replace(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)
    except OSError:
        try:
            os.unlink(temporary, dir_fd=directory)
        except OSError:
            pass


def rebuilt_on_failure(attempt: Callable[[], T]) -> T:
    """``attempt()``; where it raises after reading entries of the cache, once more computing every entry it needs
    (and storing them over the old ones). An entry with the right key can still hold a value that does not apply
    (left by someone else, or by a bug fixed since without a change to its key): it is rebuilt, not warned about
    at every start. Where the second attempt raises too, the failure was not the cache's."""
    reads, fresh = getattr(_attempt, "reads", 0), getattr(_attempt, "fresh", False)
    try:
        return attempt()
    except Exception:
        if fresh or getattr(_attempt, "reads", 0) == reads:
            raise
    _attempt.fresh = True
    try:
        return attempt()
    finally:
        _attempt.fresh = False
