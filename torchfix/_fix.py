"""A fix: one thread hazard of torch, the patches that remove it, and the rules for when to apply them."""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .patching.cache import rebuilt_on_failure

if TYPE_CHECKING:
    import random

    from .doctor.scenarios import Result

# The newest torch minor release every fix was checked against: a later one is "unsupported" until checked.
NEWEST_CHECKED = "2.15"

_RELEASE = re.compile(r"(\d+)\.(\d+)")  # what any torch version string begins with: 2.13.0+cu130, 2.16.0a0+git...


def minor_release(torch_version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version string, pre-releases and local builds included; None if it is not one.

    The one way torchfix reads a version: fixes are written against a minor release's source."""
    match = _RELEASE.match(torch_version.strip())
    return (int(match[1]), int(match[2])) if match else None


@dataclass(frozen=True)
class Releases:
    """The torch minor releases ``first`` through ``last`` (their patch releases and pre-releases too)."""

    first: tuple[int, int]
    last: tuple[int, int]

    def __contains__(self, torch_version: str) -> bool:
        release = minor_release(torch_version)
        return release is not None and self.first <= release <= self.last

    def __str__(self) -> str:
        first, last = (".".join(map(str, r)) for r in (self.first, self.last))
        return first if first == last else f"{first} - {last}"


def releases(first: str, last: str = NEWEST_CHECKED) -> Releases:
    """The torch releases from minor version ``first`` (say "2.6") through ``last``."""
    return Releases(minor_release(first), minor_release(last))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Scenario:
    """A forced interleaving of threads that shows one fix's hazard, declared by the fix.

    ``function`` lives in the fix's own module, beside the patches it tests (what several scenarios share is in
    ``torchfix.doctor.scenarios``). The doctor (``doctor.selftest.run_all``) runs every fix's scenarios with the
    fixes on; the hazard tests run each in a fresh interpreter twice, with torchfix and with its fix disabled
    (TORCHFIX_DISABLE), and assert that the hazard shows exactly where ``hazard`` says and only when disabled."""

    function: Callable[..., Result | None]  # takes ``*args, timeout=``; None where this torch lacks what it needs
    hazard: Releases  # the releases where, with the fix disabled, it must report the hazard
    args: tuple = ()
    shows: str = ""  # what the report of a disabled run contains where the hazard shows
    needs: str = ""  # what a torch on which ``function`` returns None lacks (the tests' reason to skip it)
    # When the doctor runs it: 0 first, 1 after (without the fixes it can leave torch broken: a stuck flag,
    # nn.Module patched), 2 and 3 last (overlapping exports; without its fix, 2 leaves the process's
    # pre-dispatch mode stack dirty, which 3 would then trip over).
    stage: int = 0
    crashes: Releases | None = None  # where torch itself (C++ state) can crash in it: the generated tests skip it
    needs_fix: bool = False  # the doctor runs it only where its fix is applied (without it, torch can crash)

    @property
    def name(self) -> str:
        """The call, short: ``h1_nested_trace_error('make_fx')``."""
        return f"{self.function.__name__}({', '.join(map(repr, self.args))})"

    @property
    def call(self) -> str:
        """The call as source, for a fresh interpreter that has imported torchfix (``torchfix.fixes`` imports a fix
        module on first use): ``torchfix.fixes.fx_tracing_flag.h1_nested_trace_error('make_fx')``."""
        return f"{self.function.__module__}.{self.name}"


@dataclass(frozen=True)
class SoakAction:
    """One of the soak's actions (``python -m torchfix stress --actions NAME``): what worker threads repeat, at once."""

    name: str  # in --actions and the report
    weight: int  # how often a worker picks it, against the other actions' weights
    # Called once per run, in the soak's main thread before any action: the action (it raises AssertionError with a
    # message when its result is wrong), or None where this torch lacks what it uses.
    make: Callable[[], Callable[[random.Random], None] | None]


@dataclass(frozen=True)
class SoakCheck:
    """What the soak (``python -m torchfix stress``) does and looks for about one fix's hazard; its report counts
    the errors, leaked samples and state stuck at the end under the fix's name."""

    errors: tuple[str, ...] = ()  # texts that, in the message of an error an action raised, identify this hazard
    actions: tuple[SoakAction, ...] = ()  # the actions whose own check is of this hazard
    # Made once per run, in the soak's main thread before any action (it may note torch's state then): the probe
    # the main thread, which runs no action, samples: whether it sees this hazard's state, set by another thread.
    # Its argument is True once the workers have stopped: whether the state was left set.
    leak_probe: Callable[[], Callable[[bool], bool]] | None = None


class Patch(Protocol):
    """What every patch does: source patches (``patching.patches``) and default changes (``patching.defaults``)."""

    module_name: str
    patched: bool  # after apply(): whether it changed anything (some have nothing to do in some releases)

    def apply(self) -> None: ...  # raises (and changes nothing) when torch is not the expected shape

    def revert(self) -> None: ...

    def verify(self) -> None: ...  # raises when the patch is not in effect

    def describe(self) -> str: ...  # one line for the diff header

    # The unified diff of its edits to a release whose files ``read_source`` gives ("" for a default change,
    # or a file the release lacks); raises ShapeError where the source is not the expected shape.
    def diff(self, read_source: Callable[[str], str]) -> str: ...

    # The names of torch's it makes per thread (``patching.patches.PerThreadName``), for the tests that check them.
    def per_thread_names(self) -> list: ...

    # The code objects that run torch's patched code once applied (for a source patch, those with an instruction on a
    # line it edits): a profiler that sees one of them called saw the function the patch changed run (``bench
    # equivalence`` measures so which fixes each of its cases runs). Empty for a change of a config default, which
    # no function of its own reads.
    def patched_code(self) -> set: ...


class State(str, enum.Enum):
    APPLIED = "applied"
    NOT_NEEDED = "not needed"  # the hazard is absent from this torch (fixed upstream, or not yet there)
    UNSUPPORTED = "unsupported"  # the hazard is there but this torch's version or source is not one we know
    DISABLED = "disabled"  # TORCHFIX_DISABLE
    PENDING = "pending import"  # torch is not imported yet; applied when it is
    NOT_INSTALLED = "not installed"  # before install() or after uninstall()


@dataclass(frozen=True)
class FixStatus:
    """What became of one fix in this process (``status()``), and why."""

    name: str
    state: State
    reason: str

    def __str__(self) -> str:
        return f"{self.name}: {self.state.value} ({self.reason})"


@dataclass(frozen=True)
class Fix:
    """A declarative fix.

    ``probe`` looks at the imported torch and returns why the fix is not needed, or None when the
    hazard is there. It decides before the version does, so an upstream fix in any release (a
    nightly, a backport) turns the fix off instead of patching code that changed.
    """

    name: str
    hazard: str  # one line: what goes wrong without the fix
    versions: Releases  # the torch releases whose source the patches were written against
    probe: Callable[[], str | None]
    patches: Callable[[str], list[Patch]]  # torch version -> fresh patch objects (they hold their undo state)
    # Where it stands among the fixes (``fixes.ALL``): they apply in increasing order (ties by name) and revert
    # in reverse, and status(), the doctor and the table of fixes (docs/fixes.md) list them so. No fix needs
    # another applied first (edits of one file compose in any order), so this is only its place in the list:
    # tens, leaving room for a new fix to go between two.
    order: int
    # The module whose import applies the fix (and imports the fix's module): torch, or a part of torch that
    # `import torch` does not load (importing it early would slow every program down).
    trigger: str = "torch"
    # A hazard that costs time but breaks nothing: where the fix cannot apply, status() says so, without a
    # warning (or, in strict mode, an error) in every program that compiles.
    hazard_is_cost: bool = False
    # Its patched code runs only where CUDA does (a CUDA graph's capture): the equivalence run's cases reach it on a
    # CUDA machine only (bench/equivalence_apis.py; its test on CPU expects exactly these fixes not to run).
    needs_cuda: bool = False
    scenarios: tuple[Scenario, ...] = ()  # how the doctor and the tests show the hazard (see Scenario)
    # What the generated table of fixes (docs/fixes.md) says of it, written here and nowhere else:
    shared_state: str = ""  # the process state torch shares between threads, and who sets and reads it
    symptom: str = ""  # what a user sees without the fix (measured: which torch, how often)
    releases_note: str = ""  # why ``versions`` is what it is, e.g. 'before 2.3: "not needed"'
    caveats: str = ""  # what the fix changes beyond removing the hazard, that a user may notice
    soak: SoakCheck | None = None  # what the soak does and looks for about the hazard (see SoakCheck)
    # The rows of the survey of torch's process state (docs/torch-2.15-globals.md) whose state it fixes, each as
    # "module: name" (the row's first two cells without backticks): `python -m torchfix docs` writes their verdict.
    survey_rows: tuple[str, ...] = ()

    def supports(self, torch_version: str) -> bool:
        return torch_version in self.versions

    def apply(self, torch_version: str) -> tuple[FixStatus, list[Patch]]:
        """Apply every patch or none. Returns the status and the applied patches (for revert)."""
        try:
            not_needed = self.probe()
        except Exception as exc:  # a probe that cannot even look means an unknown torch
            return self._status(State.UNSUPPORTED, f"cannot inspect torch: {exc!r}"), []
        if not_needed:
            return self._status(State.NOT_NEEDED, not_needed), []
        if not self.supports(torch_version):
            return self._status(
                State.UNSUPPORTED,
                f"the hazard is present but torch {torch_version} is outside the releases this fix "
                f"was written for ({self.versions}); nothing was patched",
            ), []
        try:
            # An entry of torchfix's cache that does not apply is rebuilt: the fix is tried again without it.
            applied = rebuilt_on_failure(lambda: self._apply_all(torch_version))
        except Exception as exc:
            return self._status(State.UNSUPPORTED, f"{exc} (nothing was patched)"), []
        return self._status(State.APPLIED, f"patched {', '.join(p.module_name for p in applied if p.patched)}"), applied

    def _apply_all(self, torch_version: str) -> list[Patch]:
        applied: list[Patch] = []
        try:
            for patch in self.patches(torch_version):
                patch.apply()
                applied.append(patch)
            for patch in applied:
                patch.verify()
        except Exception:
            revert_all(applied)
            raise
        return applied

    def diff(self, torch_version: str, read_source: Callable[[str], str]) -> str:
        """The fix's edits to a torch release as a unified diff; ``read_source`` maps a path like
        "torch/fx/x.py" to that release's text.

        Raises ShapeError where the source is not the shape the fix expects.
        """
        patches = self.patches(torch_version)
        header = [f"# torchfix fix {self.name}: {self.hazard}\n", *(f"# {patch.describe()}\n" for patch in patches)]
        return "".join(header + [patch.diff(read_source) for patch in patches])

    def _status(self, state: State, reason: str) -> FixStatus:
        return FixStatus(self.name, state, reason)


def revert_all(patches: list[Patch]) -> None:
    for patch in reversed(patches):
        patch.revert()
