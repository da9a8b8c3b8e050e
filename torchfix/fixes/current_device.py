"""current-device: ``torch.utils._device.CURRENT_DEVICE`` is each thread's own, for Dynamo's recording and guard too.

``torch.set_default_device`` is per thread from torch 2.3 (its ``DeviceContext`` lives in a ``threading.local`` and
on the calling thread's torch-function mode stack; before, in a module global: one default device for the process,
nothing per thread to keep), but ``DeviceContext.__enter__`` / ``__exit__`` save, set and restore the module
global ``CURRENT_DEVICE`` (torch 2.1+), which Dynamo records for every graph (``OutputGraph.current_device``, 2.8+;
before, ``GuardBuilder.DEFAULT_DEVICE`` reads it) and guards on (``DEFAULT_DEVICE``; from 2.4 a C++ guard that keeps
the value the module ``__dict__`` holds when it is built and compares the value there with it at each call; recent
releases read the ``__dict__`` with ``PyDict_GetItem``, no Python attribute lookup). So (2.13, forced with
events): two threads that set a default device and unset it in the order they set it leave ``CURRENT_DEVICE`` set
for good (the second saved the first's); a thread that sets no default device compiles its function again whenever
another thread has one set (its graph's guard reads the other thread's device); and a thread whose default device
differs from the one a graph was compiled under passes that graph's guard where the global holds a third thread's
(no wrong result on 2.13: where a graph makes a tensor, Dynamo also guards on the device of the ``DeviceContext`` on
the thread's own mode stack).

Each thread's value is kept per thread (``_torchfix_current_device``): ``__enter__`` and ``__exit__`` set and restore
the calling thread's own, so unsets in any order leave every thread as it set itself. Dynamo's reads of it
(``OutputGraph`` and, before 2.8, the guard's code) read the thread's own. The guard cannot be handed a per-thread
value (C++ reads the module ``__dict__``), so the ``__dict__`` holds what makes its comparison come out per thread:

* ``None`` while no thread has a default device: torch's value, and torch's guard, unchanged;
* while some thread has one, an object that compares equal to a value exactly when the calling thread's own value
  is that value (the C++ guard then calls its ``__eq__``, only while some thread has a default device: a compiled
  ``x + 1`` took 26.7 us instead of 26.3 us, torch 2.13 on the 2-core CPU machine under a load of 4 - 5);
* while a guard is built (with a lock held that its other writers take too), a record of the building thread's
  own value, which the guard keeps: compared with the live object, or with another record, it answers for the
  calling thread; compared with a plain value it declines, and the guard fails (a recompile, never a wrong pass).

A thread whose device differs from the one a graph was built with still fails the guard and compiles its own
(the scenario checks it with two threads holding cpu and meta). In one thread torch's recompiles and guards are
unchanged; the guard's code in the logs reads as torch's.

What a thread reads as ``torch.utils._device.CURRENT_DEVICE`` from Python: None while no thread has a default device;
while one does, the object above (it compares, prints, tests as true and answers ``.type`` / ``.index`` like the
thread's own device, but ``isinstance(..., torch.device)`` is False). Applied when Dynamo is imported: a default
device set before then becomes the own of the thread that imports it.
"""

from __future__ import annotations

import ast
import importlib
import queue
import threading
from collections.abc import Callable

from .._fix import Fix, Scenario, releases
from ..doctor.scenarios import Result, fresh, torch_module
from ..patching.patches import SourcePatch, WhereUsed, per_thread_class, refuse_accesses_left
from ..patching.source import Edit, ShapeError, definition, find_replaced, parse, replace_node, segment

MODULE, RELPATH = "torch.utils._device", "torch/utils/_device.py"
NAME, HELPER = "CURRENT_DEVICE", "_torchfix_current_device"
# The modules of Dynamo that read the global (which of them, and how, depends on the release).
READERS = {
    "torch._dynamo.guards": "torch/_dynamo/guards.py",
    "torch._dynamo.output_graph": "torch/_dynamo/output_graph.py",
}
PER_THREAD = "a per-thread torch.set_default_device (2.3+)"
_LIVE = object()  # the record of the live object: it answers with the calling thread's value


class _Recorded:
    """What the module ``__dict__`` holds while some thread has a default device (``recorded`` is ``_LIVE``), and
    what a guard built meanwhile keeps (the building thread's value)."""

    __slots__ = ("_devices", "recorded")

    def __init__(self, devices: _CurrentDevices, recorded: object) -> None:
        self._devices, self.recorded = devices, recorded

    def _value(self) -> object:
        return self._devices.own() if self.recorded is _LIVE else self.recorded

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _Recorded):  # the guard's check: the __dict__'s object against the one it keeps
            return self._devices.own() == other._value()
        if self.recorded is not _LIVE:  # a record against a plain value: which side is the thread's is unknown
            return NotImplemented
        return self._devices.own() == other

    __hash__ = object.__hash__

    def __bool__(self) -> bool:
        return bool(self._value())

    def __repr__(self) -> str:
        return repr(self._value())

    def __getattr__(self, name: str) -> object:
        # A reader of the global sees the thread's device's own attributes (``.type``, ``.index``); private and
        # special names stay the object's, so copying it cannot recurse before its slots are set.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._value(), name)


class _CurrentDevices:
    """``HELPER``: each thread's own ``CURRENT_DEVICE`` (seen in its backward too), and the module ``__dict__``'s
    value, switched under one lock."""

    def __init__(self) -> None:
        self._namespace = vars(importlib.import_module(MODULE))
        self._lock = threading.Lock()
        self.live = _Recorded(self, _LIVE)
        holder = per_thread_class(
            "_torchfix_current_device_tls", {"device": None}, {}, seen_in_backward=True, on_change=self._some_set
        )
        self._own = holder()

    def _some_set(self, some: bool) -> None:
        """Whether some thread has a device of its own now (called under the lock, by the holder)."""
        self._namespace[NAME] = self.live if some else None

    def own(self) -> object:
        return self._own.device

    def enter(self, device: object) -> object:
        """``DeviceContext.__enter__``: the calling thread's value becomes ``device``; returns what it was."""
        with self._lock:
            old, self._own.device = self._own.device, device
        return old

    def exit(self, device: object) -> None:
        """``DeviceContext.__exit__``: the calling thread's value becomes ``device`` (what its enter found)."""
        with self._lock:
            self._own.device = device

    def adopt(self) -> None:
        """At install: the value the global holds becomes the installing thread's own."""
        with self._lock:
            self._own.device = self._namespace[NAME]

    def capturing(self, add_guard: Callable[..., object]) -> Callable[..., object]:
        """``add_default_device_guard``, building the guard while the ``__dict__`` holds a record of the calling
        thread's value (the guard keeps what it finds there), unless it holds None (no thread has a device)."""

        def add(*args: object, **kwargs: object) -> object:
            with self._lock:
                live = self._namespace[NAME]
                if live is None:
                    return add_guard(*args, **kwargs)
                self._namespace[NAME] = _Recorded(self, self.own())
                try:
                    return add_guard(*args, **kwargs)
                finally:
                    self._namespace[NAME] = live

        return add


def _assigns_global(node: ast.AST) -> bool:
    return isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == NAME for t in node.targets)


class _OwnDevice(SourcePatch):
    """``DeviceContext.__enter__`` / ``__exit__``: the save and set of the global become ``HELPER.enter(device)``,
    the restore ``HELPER.exit(old)``; their ``global`` statements a comment."""

    def __init__(self) -> None:
        super().__init__(MODULE, RELPATH)
        self._devices: _CurrentDevices | None = None

    def describe(self) -> str:
        return super().describe() + f"; adds {HELPER} (each thread's own {NAME}, and the __dict__'s value)"

    def edits(self, source: str) -> list[Edit]:
        enter = definition(source, self.relpath, "DeviceContext.__enter__")
        exit_ = definition(source, self.relpath, "DeviceContext.__exit__")
        (save,) = find_replaced(
            self.relpath,
            enter,
            f"save of {NAME}",
            lambda n: isinstance(n, ast.Assign) and isinstance(n.value, ast.Name) and n.value.id == NAME,
        )
        (set_,) = find_replaced(self.relpath, enter, f"set of {NAME}", _assigns_global)
        (restore,) = find_replaced(self.relpath, exit_, f"restore of {NAME}", _assigns_global)
        declarations = find_replaced(
            self.relpath,
            [enter, exit_],
            f"global {NAME}",
            lambda n: isinstance(n, ast.Global) and n.names == [NAME],
            count=2,
        )
        if save.lineno > set_.lineno:
            raise ShapeError(f"{self.relpath}: DeviceContext.__enter__ sets {NAME} before it saves it")
        comment = f"# {NAME} is per thread: {HELPER}"
        return [
            replace_node(save.value, f"{HELPER}.enter({segment(source, set_.value)})"),
            replace_node(set_, "pass"),
            replace_node(restore, f"{HELPER}.exit({segment(source, restore.value)})"),
            *(replace_node(declaration, comment) for declaration in declarations),
        ]

    def helpers(self) -> dict[str, object]:
        self._devices = _CurrentDevices()
        return {HELPER: self._devices}

    def _install_state(self, module: object, source: str) -> None:
        self._devices.adopt()

    def _remove_state(self, module: object) -> None:
        vars(module)[NAME] = self._devices.own()  # the reverting thread's value becomes the global again

    def verify(self) -> None:
        super().verify()
        refuse_accesses_left(self._module, {"LOAD_GLOBAL", "STORE_GLOBAL"}, {NAME})


class _OwnDeviceReads(WhereUsed):
    """A Dynamo module's reads of ``<module>.CURRENT_DEVICE`` become ``<module>.HELPER.own()`` (in an f-string
    too), and its building of the C++ guard (``.add_default_device_guard(...)``) goes through
    ``HELPER.capturing``. A release whose module does neither has nothing to patch there."""

    def describe(self) -> str:
        return f"{self.relpath} (where it reads {NAME} or builds its guard): the calling thread's own"

    def edits(self, source: str) -> list[Edit]:
        edits, in_fstrings = [], set()
        for node in ast.walk(parse(source)):
            if isinstance(node, ast.JoinedStr):
                reads = [v.value for v in node.values if isinstance(v, ast.FormattedValue) and _reads_global(v.value)]
                if reads:
                    text = segment(source, node)
                    for read in reads:
                        base = ast.unparse(read.value)
                        if text.count("{" + base + "." + NAME) != 1:
                            raise ShapeError(f"{self.relpath} line {node.lineno}: an f-string read of {NAME}")
                        text = text.replace("{" + base + "." + NAME, "{" + base + f".{HELPER}.own()")
                    edits.append(replace_node(node, text))
                    in_fstrings.update(id(read) for read in reads)
            elif _reads_global(node) and id(node) not in in_fstrings:
                edits.append(replace_node(node, f"{segment(source, node.value)}.{HELPER}.own()"))
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_default_device_guard":
                edits.append(
                    replace_node(node.func, f"torch.utils._device.{HELPER}.capturing({segment(source, node.func)})")
                )
        return edits

    def accesses(self) -> tuple[set[str], set[str], str]:
        return {"LOAD_ATTR"}, {NAME}, ""


def _reads_global(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == NAME and isinstance(node.ctx, ast.Load)


def _per_thread_default() -> bool:
    """Whether ``set_default_device`` is per thread (torch 2.3+: its context in a ``threading.local``); before, the
    default device itself is one for the process, so there is no thread's own value to keep."""
    import torch

    return isinstance(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), threading.local)


def _probe() -> str | None:
    if not _per_thread_default():
        return "torch.set_default_device is one setting for the process (before torch 2.3)"
    if HELPER in vars(importlib.import_module(MODULE)):
        return f"{MODULE}.{NAME} is per thread already"
    return None


class _DeviceThread:
    """A thread that sets a default device and runs what it is handed (:meth:`run`) until :meth:`close`, which unsets
    it. Queues hand the calls over: each returns once the thread has run it."""

    def __init__(self, device: str, timeout: float) -> None:
        self._calls: queue.Queue = queue.Queue()
        self._timeout = timeout
        self.thread = threading.Thread(target=self._serve, args=(device,), name="torchfix-selftest", daemon=True)
        self.thread.start()
        self.run(lambda: None)  # returns once the device is set

    def _serve(self, device: str) -> None:
        import torch

        torch.set_default_device(device)
        try:
            for call, answer in iter(self._calls.get, None):
                try:
                    answer.put((True, call()))
                except Exception as exc:
                    answer.put((False, exc))
        finally:
            torch.set_default_device(None)

    def run(self, call: Callable[[], object]) -> object:
        answer: queue.Queue = queue.Queue()
        self._calls.put((call, answer))
        ok, value = answer.get(timeout=self._timeout)
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self._calls.put(None)
        self.thread.join(self._timeout)


def _module_value() -> object:
    return vars(importlib.import_module(MODULE))[NAME]


def left_set(timeout: float = 60.0) -> Result | None:
    """Thread A sets the default device meta, then thread B cpu; A unsets its own first, then B: the module's
    ``CURRENT_DEVICE`` must be None after (it is put back either way). None before torch 2.3."""
    import torch

    if not _per_thread_default():
        return None
    module = torch_module(MODULE)
    import torch._dynamo  # noqa: F401  (the fix applies with Dynamo, the reader)

    first = _DeviceThread("meta", timeout)
    second = _DeviceThread("cpu", timeout)
    first.close()
    second.close()
    left = _module_value()
    if isinstance(left, torch.device):  # torch's global, stuck: put back for later scenarios
        vars(module)[NAME] = None
    return Result(
        "set_default_device in two threads, unset in the order set",
        left is not None,
        f"CURRENT_DEVICE after both unset: {left!r}",
    )


def _twice(x):
    return x * 2


def recompiles_elsewhere(timeout: float = 60.0) -> Result | None:
    """The main thread, which sets no default device, calls its compiled function while another thread has set
    meta: it must not compile again. Then thread A (cpu) and thread C (meta) call one compiled function with the
    main thread's cpu tensor, A, C, A: C must compile its own graph (its default device differs; the function makes
    no tensor, so only the default-device guard tells them apart) and A's second call must not. None before 2.3."""
    import torch

    if not _per_thread_default():
        return None
    graphs: list[object] = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x = torch.ones(2)
    alone = torch.compile(fresh(_twice), backend=counting)
    alone(x)
    other = _DeviceThread("meta", timeout)
    try:
        alone(x)
    finally:
        other.close()
    problems = [f"the main thread (no default device) compiled again while another thread had one: {len(graphs) - 1}"]
    if len(graphs) == 1:
        problems = []
    shared = torch.compile(fresh(_twice), backend=counting)
    start, counts = len(graphs), []
    a, c = _DeviceThread("cpu", timeout), _DeviceThread("meta", timeout)
    try:
        for thread in (a, c, a):
            thread.run(lambda: shared(x))
            counts.append(len(graphs) - start)
    finally:
        c.close()
        a.close()
    if counts[0] == 0:
        seen = "A (cpu) compiled nothing: no graph under a default device on this torch"
    else:
        seen = f"graphs after A (cpu), C (meta), A: {counts}"
        if counts[1] == counts[0]:
            problems.append("C (meta) ran the graph A (cpu) compiled")
        if counts[2] != counts[1]:
            problems.append("A compiled again after C")
    return Result(
        "a compiled function in a thread with no default device, and in threads with cpu and meta",
        bool(problems),
        "; ".join(problems + [seen]),
    )


FIX = Fix(
    name="current-device",
    order=358,
    hazard="the default device a thread sets is also written to one module global, CURRENT_DEVICE: two threads "
    "that unset theirs in the order they set them leave it set for good; a thread with none recompiles while another "
    "has one",
    versions=releases("2.3"),
    probe=_probe,
    patches=lambda _torch_version: [
        _OwnDevice(),
        *(_OwnDeviceReads(module, relpath) for module, relpath in READERS.items()),
    ],
    trigger="torch._dynamo",
    scenarios=(
        Scenario(left_set, releases("2.3"), needs=PER_THREAD, shows="after both unset: device"),
        Scenario(
            recompiles_elsewhere,
            releases("2.3"),
            needs=PER_THREAD,
            shows="compiled again while another thread had one",
        ),
    ),
    shared_state=f"{MODULE}.{NAME}: saved, set and restored by DeviceContext.__enter__ / __exit__ "
    "(torch.set_default_device, per thread otherwise); read by Dynamo's OutputGraph and its DEFAULT_DEVICE guard "
    "(C++ from 2.4: the module __dict__, at every compiled call)",
    symptom="two threads that set a default device and unset it in the order they set it left CURRENT_DEVICE = meta "
    "for good; the main thread, with no default device, compiled its function again while another thread had one; "
    "a thread with meta ran the graph a thread with cpu compiled (2.13, 2.14.1, 2.15, forced with events); its two "
    "scenarios: 5 of 5 runs on 2.13, 3 of 3 on 2.14.1 and 2.15 without the fix, none with it",
    releases_note="2.3 - 2.15; before 2.3 set_default_device itself is one setting for the process (its context a "
    'module global), so no thread has a value of its own: "not needed"; its guard is Python up to 2.3, C++ from 2.4',
    caveats="while some thread has a default device, torch.utils._device.CURRENT_DEVICE read from Python is an "
    "object that compares, prints and answers .type/.index as the calling thread's own device (isinstance "
    "torch.device is False), and each compiled "
    "call's default-device guard calls its __eq__ (+0.4 us a call, on a loaded CPU machine); a default device set "
    "before Dynamo is imported becomes the importing thread's own",
    survey_rows=("torch/utils/_device.py: CURRENT_DEVICE",),
)
