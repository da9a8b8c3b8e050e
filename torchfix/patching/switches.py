"""Counted overrides of process switches: C++ settings that torch changes from Python for a while.

Some of what torch changes for the time of a context manager is not Python state but a setting of its C++ library,
one per process: ``torch.backends.mkldnn.set_flags(False)`` (every export), the SDPA backend switches
(``sdpa_kernel``). A per-thread value is out of reach for them: the C++ operators read the one setting, whichever
thread runs them, so while one thread holds an override every thread runs with it. What can be made right is the
saving and restoring, which torch does per entry (each entry saves what it found and writes it back at its exit):

* entries that overlap in several threads are counted, so exits in any order leave each switch as it was before
  the first entry (torch: the entry that leaves last writes back the value of the other, which is then left on);
* an exit writes back only the switches its entry set, and only one that still holds the value the overrides set:
  a value set since by anyone stays (torch writes back every setting of its saved tuple, undoing another thread's
  ``torch.backends.cudnn.deterministic = True`` made meanwhile). In one thread this is what torch does, but for a
  switch the entry did not change (it found the value it sets): there a change made inside the entry stays after
  it, where torch would undo it.

:class:`Override` is one entry's overrides of several switches. :func:`compile_view` is what a compile runs with:
the switches as the compiling thread itself set them, so that a graph does not keep a choice that another
thread's temporary override made (torch guards none of these switches). Overrides of a trace (an export's) do not
yield to a compile: two traces that need a switch set both ways at once cannot both have it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Switch:
    """One process-wide setting: its name, and torch's getter and setter of it."""

    name: str
    get: Callable[[], object] = field(compare=False)
    set: Callable[[object], object] = field(compare=False)


@dataclass(eq=False)
class _Entry:
    """One override of a switch under way, in the order they were entered."""

    value: object  # what the entry set
    found: object  # what it writes back at its exit (passed on to it by an older entry that left first)
    thread: int
    yields_to_compiles: bool


_lock = threading.Lock()  # every read-modify-write of the switches below, and of their entries
_switches: dict[str, Switch] = {}
_entries: dict[str, list[_Entry]] = {}  # switch name -> its entries that have not left yet, oldest first


class Override:
    """The overrides of one entry: ``enter()`` sets each switch ``values()`` names to its value, all or none;
    ``exit()`` takes them back (nothing if the entry never got in).

    ``yields_to_compiles``: whether a compile in another thread runs with this entry's values or with its own
    (:func:`compile_view`): True for a setting that eager code asks for (``sdpa_kernel``), False for one a trace
    needs while it runs (an export's)."""

    def __init__(self, values: Callable[[], dict[Switch, object]], yields_to_compiles: bool = True) -> None:
        self.values, self.yields_to_compiles = values, yields_to_compiles
        self._entered: list[tuple[Switch, _Entry]] = []

    def enter(self) -> Override:
        with _lock:
            values = self.values()
            try:
                for switch, value in values.items():
                    entry = _Entry(value, switch.get(), threading.get_ident(), self.yields_to_compiles)
                    switch.set(value)
                    _switches[switch.name] = switch
                    _entries.setdefault(switch.name, []).append(entry)
                    self._entered.append((switch, entry))
            except BaseException:
                self._take_back()
                raise
        return self

    def exit(self) -> None:
        with _lock:
            self._take_back()

    def _take_back(self) -> None:
        while self._entered:
            switch, entry = self._entered.pop()
            stack = _entries[switch.name]
            at = stack.index(entry)
            if at == len(stack) - 1:  # the newest entry: write back what it found, unless someone set it since
                if switch.get() == entry.value:
                    switch.set(entry.found)
            elif stack[at + 1].found == entry.value:  # the next entry found this one's value: an override, not a
                stack[at + 1].found = entry.found  # setting; it writes back what this one found instead
            del stack[at]
            if not stack:
                del _entries[switch.name]

    def __enter__(self) -> Override:
        return self.enter()

    def __exit__(self, *exc_info: object) -> None:
        self.exit()


def _own(stack: list[_Entry], me: int) -> object:
    """What thread ``me`` set a switch with entries ``stack`` to: its newest entry's value, or else the value before
    the first entry."""
    mine = [entry for entry in stack if entry.thread == me]
    return mine[-1].value if mine else stack[0].found


def own_value(switch: Switch) -> object:
    """The switch as the calling thread set it: the switch itself where no entry holds it (a value set directly
    is seen), else :func:`_own` of its entries."""
    with _lock:
        stack = _entries.get(switch.name)
        return _own(stack, threading.get_ident()) if stack else switch.get()


def _own_view() -> dict[Switch, object]:
    """The overridden switches whose value now comes from another thread's entry that yields to compiles, each with
    the value the calling thread sees of its own (:func:`_own`)."""
    me, view = threading.get_ident(), {}
    for name, stack in _entries.items():
        others = [entry for entry in stack if entry.thread != me]
        if not others or not all(entry.yields_to_compiles for entry in others):
            continue
        value = _own(stack, me)
        if _switches[name].get() != value:
            view[_switches[name]] = value
    return view


@contextmanager
def compile_view() -> Iterator[None]:
    """While a compile runs: the switches other threads' overrides hold, set to what the compiling thread sees of
    its own (an override like the others, so that entries leaving meanwhile are counted right). Nothing is set
    where no other thread holds one, so a compile in one thread runs exactly as without torchfix."""
    if not _entries:  # no override at all (a read of a dict: no lock needed to see it empty)
        yield
        return
    with Override(_own_view):
        yield
