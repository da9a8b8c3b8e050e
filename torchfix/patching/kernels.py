"""Operators' Python kernels (``OpOverload.py_kernels``) made the overriding thread's own while it overrides them.

Torch code that overrides an operator's Python-dispatcher kernels for a while edits ``op.py_kernels`` in place and
restores it at its end, for the whole process. While any thread is inside such an override, the op's table is a
view (:class:`_ThreadKernels`) of the calling thread's own copy, which torch's code edits and restores as before,
or of the op's real table for any other thread; when the last thread is out, the op gets its own table back.

``op._dispatch_cache`` (what ``op._get_dispatch`` resolved, by dispatch key) is read by torch's C++ dispatcher
itself, not through Python, so an entry serves every thread alike. An override that registers its kernels with
``py_impl`` (which clears that cache) gets a dict that keeps nothing (:class:`_Uncached`) while it is under way:
the C++ dispatcher then asks ``op._get_dispatch`` each time, which resolves against the calling thread's table;
after the last such override the op gets its cache back, cleared, as torch leaves it. An override that writes
``py_kernels`` without clearing the cache (``cached=True``) leaves it in place, as torch does: what it held goes on
serving the overriding thread (and every thread), and what is resolved meanwhile is cached for all, as torch
caches it.

The per-thread tables live in :class:`ThreadSpaces`, which follow a thread into autograd's device thread (torch
2.13+). One :func:`shared` serves every fix that overrides kernels, so that two of them can override one op.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from dataclasses import dataclass

from .stash import ThreadSpaces


class _Uncached(dict):
    """``op._dispatch_cache`` while some thread overrides the op with ``py_impl``: empty for good, so that torch's
    C++ dispatcher, which looks handlers up in the dict itself, always asks ``op._get_dispatch``."""

    def __setitem__(self, key: object, value: object) -> None:
        pass


@dataclass
class _Own:
    """A thread's own py_kernels of one op, while it overrides them."""

    table: dict  # the thread's copy of the op's py_kernels, which torch's code edits
    depth: int = 0  # the thread's overrides of the op under way (they nest: torch 2.5 - 2.7 enter two at once)


class _ThreadKernels(MutableMapping):
    """``op.py_kernels`` while some thread has its own kernels for the op: the calling thread's table where it has
    one (on autograd's device thread, the table of the thread whose backward it runs), the op's real one otherwise."""

    def __init__(self, op: object, shared: dict, overrides: OpKernels) -> None:
        self._op, self._shared, self._overrides = op, shared, overrides

    def _table(self) -> dict:
        own = self._overrides.own(self._op)
        return self._shared if own is None else own.table

    def __getitem__(self, key: object) -> object:
        return self._table()[key]

    def __setitem__(self, key: object, value: object) -> None:
        self._table()[key] = value

    def __delitem__(self, key: object) -> None:
        del self._table()[key]

    def __contains__(self, key: object) -> bool:
        return key in self._table()

    def __iter__(self) -> Iterator:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())

    def get(self, key: object, default: object = None) -> object:
        return self._table().get(key, default)

    def copy(self) -> dict:
        return self._table().copy()

    def clear(self) -> None:
        self._table().clear()

    def __repr__(self) -> str:
        return repr(self._table())


class OpKernels:
    """The ops that threads override, and each thread's own kernel tables for them."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._threads = ThreadSpaces("op-kernels", seen_in_backward=True)
        self._real: dict[object, dict] = {}  # op -> its own py_kernels, set aside
        self._caches: dict[object, dict] = {}  # op -> its own _dispatch_cache, set aside while uncached
        self._inside: Counter = Counter()  # op -> the overrides of it under way, in all threads
        self._uncached: Counter = Counter()  # op -> those of them that need the op uncached

    def own(self, op: object) -> _Own | None:
        tables = self._tables()
        return None if tables is None else tables.get(op)

    def _tables(self) -> dict[object, _Own] | None:
        """The calling thread's own tables, by op; None where it has overridden nothing."""
        return getattr(self._threads.get(), "tables", None)

    def locked(self, items: Iterable) -> Iterator:
        """The items of torch's setup loop, with the lock held while it runs: two threads' setups take turns."""
        with self._lock:
            yield from items

    def enter(self, op: object, cached: bool = False) -> dict:
        """The calling thread starts overriding ``op`` (``cached``: without clearing its dispatch cache): returns a
        copy of its table, what torch saves to restore."""
        with self._lock:
            if op not in self._real:
                self._real[op] = op.py_kernels
                op.py_kernels = _ThreadKernels(op, op.py_kernels, self)
            if not cached:
                if op not in self._caches:
                    self._caches[op], op._dispatch_cache = op._dispatch_cache, _Uncached()
                self._uncached[op] += 1
            tables = vars(self._threads.make()).setdefault("tables", {})
            own = tables.get(op)
            if own is None:
                own = tables[op] = _Own(dict(self._real[op]))
            own.depth += 1
            self._inside[op] += 1
            return own.table.copy()

    def leave(self, op: object, last_out: Callable[[object], None] | None = None, cached: bool = False) -> None:
        """The calling thread ends an override of ``op`` (torch has restored its table), entered with the same
        ``cached``. After the last uncached one, the op gets its cache back, cleared as torch leaves it, and
        ``last_out(op)`` runs (torch's removal of the fake rule); after the last of all, its own table."""
        with self._lock:
            tables = self._tables()
            tables[op].depth -= 1
            if tables[op].depth == 0:
                del tables[op]
            if not cached:
                self._uncached[op] -= 1
                if not self._uncached[op]:
                    del self._uncached[op]
                    cache = op._dispatch_cache = self._caches.pop(op)
                    cache.clear()
                    if last_out is not None:
                        last_out(op)
            self._inside[op] -= 1
            if not self._inside[op]:
                del self._inside[op]
                op.py_kernels = self._real.pop(op)


@functools.cache
def shared() -> OpKernels:
    """The one :class:`OpKernels` of the process (made once torch is imported: it keeps tables in its stash)."""
    return OpKernels()
