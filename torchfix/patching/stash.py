"""Python objects a thread keeps in torch's C++ thread-local stash, taken out again before the thread ends.

``torch._C._stash_obj_in_tls`` keeps an object in C++ thread-local state, which autograd copies into the
device thread that runs this thread's backward: that is how CUDA graph trees (and torchfix's per-thread
step counters) reach a thread's own objects there, and how :class:`ThreadSpaces` makes all of torchfix's
per-thread state follow a thread into its backward. C++ destroys that state only when the OS thread exits,
after Python has let the thread go (``join()`` has returned): the last reference to the thread's CUDA
graph trees then drops in a C++ thread-exit destructor, which takes the GIL once more to run their
teardown for a thread Python no longer knows (``threading`` sees a ``_DummyThread`` there); at interpreter
exit the GIL can no longer be taken and the process aborts ("terminate called without an active
exception": torch 2.13, CPU, 3 of 78 runs of a process whose one thread made its trees and was joined).
Upstream added ``_remove_obj_from_tls`` after a deadlock of the same kind (pytorch/pytorch#182083).

``stash_until_thread_end`` stashes as torch does and hands the key to the thread's releaser, a
``threading.local`` value (``adopt_until_thread_end`` hands over an entry torch stashed itself). Python drops
those at the thread's end while the thread still runs Python, and the releaser takes its keys out there: with
``_remove_obj_from_tls`` (torch 2.13+); before, by stashing None over them, so that the objects go and only a
reference to None is left to the C++ exit.

Up to torch 2.12 the stash keeps the object's pointer without taking a reference (and drops one when the
entry is replaced or destroyed): an object only the stash still held was freed while the stash handed it
out (seen: after ``torchfix.uninstall()`` and ``install()``, the next ``cudagraph_mark_step_begin()`` read
freed memory, a segfault on 2.10 and an unrelated object on 2.2). ``_stash`` gives the stash the reference
it will drop, where a probe shows that it takes none.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import sys
import threading
import types

PROBE = "torchfix_stash_probe"
SPACES = "torchfix.spaces"  # ThreadSpaces' one entry per thread: that thread's namespaces by key


def _torch_c() -> types.ModuleType:
    """``torch._C``, from ``sys.modules``: an ``import torch`` in a thread waits while another thread imports torch,
    and torchfix's own checks start threads while torch is being imported (its fixes apply then)."""
    return sys.modules["torch"]._C


@functools.cache
def _stash_takes_a_reference() -> bool:
    """Whether ``torch._C._stash_obj_in_tls`` takes a reference to what it keeps (torch 2.13+), measured once."""
    C = _torch_c()
    probe: list = []  # a new object, of which this frame holds the only reference
    before = sys.getrefcount(probe)
    C._stash_obj_in_tls(PROBE, probe)
    takes = sys.getrefcount(probe) > before
    if not takes:  # the reference the stash drops when the entry goes or is replaced
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(probe))
    remove = getattr(C, "_remove_obj_from_tls", None)
    if remove is not None:  # taken out again: each entry of a thread's stash costs every node of its backwards
        remove(PROBE)
    else:  # an entry stays until the OS thread exits: only a reference to None is left to it
        if not takes:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(None))
        C._stash_obj_in_tls(PROBE, None)
    return takes


def _stash(key: str, obj: object) -> None:
    """``torch._C._stash_obj_in_tls(key, obj)``, with the stash owning a reference to ``obj`` on every release."""
    C = _torch_c()
    if not _stash_takes_a_reference():
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    C._stash_obj_in_tls(key, obj)


class _Releaser:
    """Takes one thread's stash entries out when the thread's thread-local values are dropped."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    def __del__(self) -> None:
        if sys.is_finalizing():  # the main thread's, at interpreter exit: the process takes the state along
            return
        C = _torch_c()
        remove = getattr(C, "_remove_obj_from_tls", None)
        for key in self.keys:
            if not C._is_key_in_tls(key):
                continue
            if remove is not None:
                remove(key)
            else:
                _stash(key, None)


class _ThisThread(threading.local):
    releaser: _Releaser | None = None


_this_thread = _ThisThread()


def _release_at_thread_end(key: str) -> None:
    releaser = _this_thread.releaser
    if releaser is None:
        releaser = _this_thread.releaser = _Releaser()
    if key not in releaser.keys:
        releaser.keys.append(key)


def stash_until_thread_end(key: str, obj: object) -> None:
    """``torch._C._stash_obj_in_tls(key, obj)``, taken out again when the calling thread ends."""
    _stash(key, obj)
    _release_at_thread_end(key)


def adopt_until_thread_end(key: str) -> None:
    """The entry ``key`` that torch itself stashed in the calling thread, taken out again when the thread ends,
    as if ``stash_until_thread_end`` had put it there.

    ``torch._inductor.cudagraph_trees`` stashes the importing thread's tree containers at import, and the
    importing thread is whichever thread compiles the first ``mode="reduce-overhead"`` graph: often a worker
    that ends long before the process. Up to torch 2.12 that entry holds no reference of its own, so when the
    thread ends Python frees the containers and the entry's C++ destructor, at the OS thread's exit, drops a
    reference to freed memory; here it gets the reference it will drop. Entries already released at the
    thread's end, or absent, are left as they are."""
    C = _torch_c()
    releaser = _this_thread.releaser
    if (releaser is not None and key in releaser.keys) or not C._is_key_in_tls(key):
        return
    if not _stash_takes_a_reference():
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(C._get_obj_in_tls(key)))
    _release_at_thread_end(key)


class ThreadSpaces:
    """One namespace per thread: all that torchfix keeps per thread, made here, each maker saying whether a backward
    on autograd's device thread sees the namespace of the thread whose backward it runs (``seen_in_backward``).
    (:func:`torchfix.patching.patches.per_thread_class` holds moved globals in one of these, or in its call-free
    ``threading.local`` form where they are not seen in a backward.)

    On CUDA, autograd runs a backward on its device thread, one for all threads, and so does AOTAutograd when it
    traces a joint graph's backward (``torch.autograd.grad`` on fake CUDA tensors). State torch keeps in a module
    global is seen there as the tracing thread left it; state moved to a ``threading.local`` would read its default
    there (measured on an H200, torch 2.11: the backward nodes of a ``make_fx`` joint trace lost their ``seq_nr``,
    and the make_fx tracer read None). So each thread's namespace lives in torch's C++ stash, which autograd copies
    into the device thread for the backward's duration, and leaves it at the thread's end.

    Only where torch can take an entry out of the stash (``_remove_obj_from_tls``, torch 2.13+): before, an entry
    stays until C++ destroys it at the OS thread's exit, which takes the GIL and aborts the process when that
    races interpreter exit (torch 2.10: 4 of torchfix's tests died so, "terminate called without an active
    exception" or a segfault, once every thread that set any state had an entry). There, and on 2.0, it is a
    ``threading.local``, and a backward traced on the device thread reads the defaults.

    ``seen_in_backward=False``: a ``threading.local`` on every release, for state that means nothing in a backward
    (the device thread then sees no namespace).

    All of a thread's namespaces share one stash entry (``SPACES``, a dict by key): autograd copies the whole stash
    into and out of the thread that runs each node of every backward, so each entry costs every node (docs/measured.md,
    "An eager backward and the stash"). A namespace made on the device thread while it runs a thread's backward goes
    into that thread's dict, where that thread sees it, as it sees the namespaces it made itself and the device thread
    writes to.

    A read of the stash costs about 70 ns, a ``threading.local`` attribute about 30 ns: the per-thread holders read
    here only while some thread holds a value of its own (see ``patches.per_thread_class``).
    """

    _keys = itertools.count()  # a key per instance, never reused: a namespace left from an uninstalled one stays apart

    def __init__(self, name: str, *, seen_in_backward: bool) -> None:
        C = _torch_c()
        self._key = f"torchfix.{name}.{next(self._keys)}"
        in_stash = seen_in_backward and hasattr(C, "_remove_obj_from_tls")
        self._local = None if in_stash else threading.local()
        self._has, self._get = getattr(C, "_is_key_in_tls", None), getattr(C, "_get_obj_in_tls", None)

    def get(self) -> types.SimpleNamespace | None:
        """The calling thread's namespace (the backward's thread's, on autograd's device thread), or None."""
        if self._local is not None:
            return getattr(self._local, "space", None)
        spaces = self._get(SPACES) if self._has(SPACES) else None
        return None if spaces is None else spaces.get(self._key)

    def make(self) -> types.SimpleNamespace:
        """The calling thread's namespace, made empty if it has none. (The read of a per-thread object runs it every
        time: the stash is read once, with no call of ``get``.)"""
        if self._local is not None:
            space = getattr(self._local, "space", None)
            if space is None:
                space = self._local.space = types.SimpleNamespace()
            return space
        spaces = self._get(SPACES) if self._has(SPACES) else None
        if spaces is None:  # the thread's first namespace
            spaces = {}
            stash_until_thread_end(SPACES, spaces)
        space = spaces.get(self._key)
        if space is None:
            space = spaces[self._key] = types.SimpleNamespace()
        return space
