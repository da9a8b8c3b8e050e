"""``python -m torchfix watch``: find process state that one thread changes while other threads can see it, by
looking at it from another thread while the work runs.

A reading of torch's source finds state written by ``global`` statements; it misses C++ switches set from Python
(``torch.backends`` flags, SDPA backends), state on objects (``OpOverload.py_kernels``) and files outside the
reading. The watcher instead samples, from a thread of its own that does no work, what any thread would see:

* the plain values (bools, numbers, strings, None) and the functions and classes held by the globals of every
  loaded ``torch`` module, by the attributes of every class defined there and by the attributes of the objects of
  torch's classes they hold (there also lists, tuples, dicts and sets, by kind and length);
* the Python kernels of every operator overload made so far (``OpOverload.py_kernels``: which dispatch keys have
  one, and which function);
* every zero-argument getter of ``torch._C`` that returns a plain value (``_get_mkldnn_enabled``,
  ``_get_flash_sdp_enabled``, ``_get_deterministic_algorithms``, ...).

Per-thread state (``threading.local``, ContextVars, torch's thread-local C++ state, what torchfix makes per
thread) reads the watcher's own value, which no other thread changes: what the watcher sees change is shared
(torchfix's per-thread dispatchers and the globals its fixes move are read so too). Each
change is reported with the stacks of the other threads at the sample that first saw it (the thread inside the
context manager that set it is among them), and whether it came back: a value set and restored while work ran is
a temporary process-wide setting, the hazard family the trust issue is about; one never restored may be a stuck
flag, a cache filled lazily, or a counter. What was triaged is :data:`DECLARED`.
"""

from __future__ import annotations

import collections
import contextlib
import fnmatch
import json
import operator
import re
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..patching.patches import fast_read_globals
from ..patching.slots import seen_by_this_thread

_PLAIN = (bool, int, float, str, type(None))
_OTHER = "<an object>"  # a value that is neither plain, nor a function or class: compared by kind only
KERNELS_EVERY = 8  # the operators' kernels (thousands) are read at every 8th sample, the rest at every one

# What the watcher does not report as new, all in this one place. ------------------------------------------------
# Names whose values change in normal running, not settings: counters and ids that only grow, timings.
_COUNTER_WORDS = ("count", "counter", "_id", "next_", "generation", "seq", "_nr", "time", "_idx", "index")


@dataclass(frozen=True)
class Declared:
    """Names (an ``fnmatch`` pattern over the watched name) whose change was triaged: ``benign`` ones are not
    watched; ``known`` ones are reported as known, with the reason, where ``fix`` (a fix's name) is applied or
    none is named, and as new where that fix is not applied (there the change is the hazard it fixes)."""

    pattern: str
    verdict: str  # "benign" or "known"
    reason: str
    fix: str = ""


_LAZY = "a cache or singleton filled once, on first use; a racing second fill makes an equal one"
_ONCE = "a registration made once (at import, or on first use, then a flag set after it), the same for every thread"
_PATCHER = "TorchPatcher.patch() (functools.cache'd, at the first compile) or torch._dynamo's import wraps it in "
_PATCHER += "torch._disable_dynamo once per process, for every thread alike"
_LOCKED = "inductor lowering state (save/set/restore), serialized by compile_lock for torch.compile; a concurrent "
_LOCKED += "unlocked AOTInductor / standalone_compile / torch._inductor.compile can race it (not fixed)"
_TRANSFORMERS = "transformers' guard_torch_init_functions() / no_init_weights() (from_pretrained) replaces "
_TRANSFORMERS += "torch's functions for the process while a model loads: not torch's state (not fixed)"
_EXPORT_OFF = "every export turns the backend off for its traces: one C++ setting per process, out of reach "
_EXPORT_OFF += "(counted, never left off, another thread's setting kept)"
DECLARED = (
    Declared(
        "torch._dynamo.utils._METRICS_CONTEXT._*",
        "benign",
        "the compile's metrics for its log record (nesting level, metrics so far), while torch.compile holds "
        "compile_lock; logging only",
    ),
    Declared(
        "torch.fx.experimental.proxy_tensor.ORIGINAL_ATEN",
        "known",
        "torch 2.0 - 2.12: the op a make_fx trace is inside, a module global (a ContextVar from 2.13): another "
        "thread's trace meanwhile records it as its nodes' `original_aten` meta; node metadata only (not fixed)",
    ),
    Declared("torch._subclasses.fake_tensor.FakeTensorMode.cache_*", "benign", "statistics of the FakeTensor cache"),
    Declared("torch._dynamo.utils.curr_frame", "benign", "a debug frame counter"),
    Declared("torch._functorch._aot_autograd.logging_utils.nth_graph", "benign", "a debug graph counter"),
    Declared("torch._inductor.metrics.*", "benign", "debug counters of inductor's codegen, read by tests only"),
    Declared("torch.fx.experimental.recording.NEST", "benign", "the indentation of a debug log"),
    Declared("torch._dynamo.utils.CHROMIUM_EVENT_LOG", "benign", _LAZY),
    Declared("torch._dynamo.guards._CLOSURE_VARS", "benign", _LAZY),
    Declared("torch._dynamo.pgo._CODE_STATE", "benign", _LAZY + " (profile-guided sizes, keyed by code)"),
    Declared("torch._inductor.pattern_matcher._debug_nodes_cache", "benign", _LAZY + " (an environment variable)"),
    Declared(
        "torch._opaque_base._FakeScriptObject_cls", "benign", _LAZY + " (a class, cached to break an import cycle)"
    ),
    Declared("torch._inductor.dtype_propagation.DtypePropagationOpsHandler._instance", "benign", _LAZY),
    Declared(
        "torch._dynamo.variables.constant.CONSTANT_VARIABLE_*.source_location",
        "benign",
        "Dynamo's shared None/True/False constants keep the source location of the first trace that pushed them, the "
        "same in one thread (only graph-break messages read it)",
    ),
    Declared("torch.utils.checkpoint.DefaultDeviceType._default_device_type", "benign", _LAZY + " (a device type)"),
    Declared("torch.autograd.profiler._cupti_monitor_*", "benign", _LAZY + " (an optional module)"),
    Declared("torch._dynamo.device_interface._device_initialized", "benign", _ONCE),
    Declared(
        "torch._dynamo.utils._gc_threshold_*",
        "benign",
        "deferred_full_gc (2.15) raises the process's gen2 GC threshold while any thread compiles, counted under a "
        "lock by torch itself: the last compile out restores it (GC timing only)",
    ),
    Declared(
        "torch.*._lazy_seed_tracker.*",
        "benign",
        "torch.manual_seed's calls, kept for a device's lazy init: the seed is the process's by design",
    ),
    Declared("torch._inductor.codegen.common._device_op_overrides_initialized", "benign", _ONCE),
    Declared("torch.distributed.device_mesh._distributed_opaque_types_registered", "benign", _ONCE),
    Declared("torch._higher_order_ops.invoke_leaf_function._leaf_function_module_retriever", "benign", _ONCE),
    Declared("aten.miopen_batch_norm.default", "benign", _ONCE + " (torch._inductor.decomposition's py_impl)"),
    Declared("torch.jit.trace", "benign", _PATCHER),
    Declared("torch.jit.trace_module", "benign", _PATCHER),
    Declared("torch.jit._get_trace_graph", "benign", _PATCHER),
    Declared("torch.fx._symbolic_trace.Tracer.trace", "benign", _PATCHER),
    Declared("torch.manual_seed", "benign", _PATCHER),
    Declared("torch.optim.*._init_group", "benign", _PATCHER),
    Declared("torch.optim.*._fused_*", "benign", _PATCHER),
    Declared("torch.optim.lbfgs.LBFGS.step", "benign", _PATCHER),
    Declared("torch.optim.sparse_adam.SparseAdam.step", "benign", _PATCHER),
    Declared(
        "torch.distributions.distribution.Distribution._validate_args",
        "benign",
        "TorchPatcher.patch() calls Distribution.set_default_validate_args(False) once per process, at the first "
        "compile",
    ),
    Declared("torch._C._get_mkldnn_enabled()", "known", _EXPORT_OFF, fix="export-backend-switches"),
    Declared("torch._C._get_nnpack_enabled()", "known", _EXPORT_OFF, fix="export-backend-switches"),
    Declared(
        "torch._C._get_cudnn_enabled()", "known", _EXPORT_OFF + " (cuDNN from 2.11)", fix="export-backend-switches"
    ),
    Declared(
        "torch._C._get_*_sdp_enabled()",
        "known",
        "sdpa_kernel's backend switches: one C++ setting per process, out of reach for eager SDPA (counted, never left "
        "changed; compiles see their own thread's)",
        fix="sdpa-kernel-switches",
    ),
    Declared(
        "torch._dynamo.compiled_autograd.active_disable_ctx",
        "known",
        "mirrors compiled autograd's compiler slot, one per process in C++, which every AOTAutograd compile clears "
        "(compiled_autograd._disable) for its time: out of reach while it runs (counted: an _enable() in another "
        "thread that exits first is no longer left installed)",
        fix="compiled-autograd-compiler",
    ),
    Declared(
        "torch._functorch._aot_autograd.logging_utils.callback_set",
        "known",
        "set by the stack-trace hooks of a joint graph's traced backward: a compile (compile_lock) and an unlocked "
        "joint trace at once can leave the second's nodes with another node's stack_trace (debug metadata; not fixed)",
    ),
    Declared(
        "torch.fx.graph.CodeGen._sym_repr",
        "known",
        "print_readable(fast_sympy_print=True) (AOTAutograd's cache, inductor's post-grad artifact) swaps the printer "
        "of symbolic sizes for the process while it prints: another thread's readable code meanwhile shows sympy's "
        "form, and two overlapping exits can leave it for good (cosmetic; now per thread)",
        fix="fx-sym-repr",
    ),
    Declared("torch.nn.init.*", "known", _TRANSFORMERS),
    Declared("torch.nn.modules.activation.constant_", "known", _TRANSFORMERS),  # imported by name there
    Declared("torch.nn.modules.activation.xavier_*", "known", _TRANSFORMERS),
    Declared("torch.nn.modules.transformer.xavier_uniform_", "known", _TRANSFORMERS),
    Declared(
        "torch.linspace",
        "known",
        "transformers' meta_device_safe_creation_ops() (from_pretrained) replaces it for the process while a model "
        "loads, defaulting device='cpu': not torch's state (not fixed)",
    ),
    Declared("torch._inductor.ir.ConstantBuffer.override_device", "known", _LOCKED),
    Declared("torch._inductor.triton_bundler.TritonBundler.*", "known", _LOCKED),
)
_BENIGN = re.compile("|".join(fnmatch.translate(d.pattern) for d in DECLARED if d.verdict == "benign"))


def known_reason(name: str, applied: set[str]) -> str | None:
    """Why a change of ``name`` is known (triaged) with the fixes ``applied``; None where it is new."""
    for declared in DECLARED:
        if declared.verdict == "known" and fnmatch.fnmatchcase(name, declared.pattern):
            return declared.reason if not declared.fix or declared.fix in applied else None
    return None


_CONTAINERS = (list, tuple, dict, set, collections.defaultdict)


def _key_of(value: object, containers: bool = False) -> object:
    """What is compared of a value: itself if plain, its identity if a function or class, with ``containers`` a
    container's kind and length, else :data:`_OTHER` (objects that mutate, caches and registries, are not watched;
    None turning into one is)."""
    kind = type(value)  # type(), not isinstance(): that reads __class__, which some deprecated objects warn on
    if kind in _PLAIN:
        return value
    if containers and kind in _CONTAINERS:  # an object's list swapped for another (the mode stack manager's)
        return ("container", kind.__name__, len(value))
    if kind is types.FunctionType:  # torchfix's per-thread dispatcher of a patched slot: what this thread calls
        value = seen_by_this_thread(value)
        kind = type(value)
    if kind in (types.FunctionType, types.BuiltinFunctionType) or issubclass(kind, type):
        return ("object", id(value), value.__qualname__ if hasattr(kind, "__qualname__") else repr(value))
    return _OTHER


@dataclass
class Change:
    """One watched name while it differs from its value at the start."""

    name: str
    kind: str  # "module global", "class attribute", "python kernels", "C++ switch"
    before: object
    seen: list[object] = field(default_factory=list)  # the values seen, in order, without repeats
    samples: int = 0  # samples that saw it changed
    restored: bool = False  # seen back at its value before, after a change
    stacks: dict[str, list[str]] = field(default_factory=dict)  # other threads' stacks when first seen changed

    def describe(self) -> dict:
        show = [_shown(v, self.before) for v in self.seen[:5]]
        return {
            "name": self.name,
            "kind": self.kind,
            "before": _shown(self.before) if not isinstance(self.before, frozenset) else f"{len(self.before)} kernels",
            "seen": show,
            "samples": self.samples,
            "restored": self.restored,
            "stacks": self.stacks,
        }


def _shown(key: object, before: object = None) -> object:
    """A watched value for the report; an operator's kernels as what changed since ``before``."""
    if isinstance(key, tuple) and key[:1] == ("object",):
        return f"{key[2]} (object {key[1]:#x})"
    if isinstance(key, tuple) and key[:1] == ("container",):
        return f"a {key[1]} of {key[2]}"
    if isinstance(key, frozenset):
        if not isinstance(before, frozenset):
            return f"{len(key)} kernels"
        changed = sorted({str(dispatch_key).replace("DispatchKey.", "") for dispatch_key, _ in key ^ before})
        return f"{len(key)} kernels, {len(changed)} keys changed: {', '.join(changed[:6])}{' ...' * (len(changed) > 6)}"
    return key if type(key) in _PLAIN else repr(key)


class Watcher:
    """Samples torch's process state from its own thread every ``interval`` seconds between :meth:`start` and
    :meth:`stop`; :attr:`changes` is what it saw differ from the state at :meth:`start`."""

    def __init__(self, interval: float = 0.02, ignore_benign: bool = True) -> None:
        self.interval = interval
        self.ignore_benign = ignore_benign  # leave out counters and the names DECLARED benign
        self.changes: dict[str, Change] = {}
        self.samples = 0
        self.sample_seconds = 0.0  # time spent sampling (holding the GIL): the watcher's cost
        # The watched names of one module's or class's dict: read together (C-level map and list compare), cheap to
        # sample often.
        self._namespaces: list[_Namespace] = []
        self._readers: list[tuple[str, str, Callable[[], object], object]] = []  # (name, kind, read, read() at start)
        self._switches: list[tuple[str, str, Callable[[], object], object]] = []  # the C++ getters among them
        self._seen_modules: set[str] = set()
        self._seen_objects: set[int] = set()
        self._stacks: dict[str, list[str]] | None = None  # the other threads' stacks at this sample, once needed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # What is watched -----------------------------------------------------------------------------------------

    def _add(self, name: str, kind: str, read: Callable[[], object]) -> None:
        """Watch what ``read()`` returns (a C++ getter, an operator's kernels)."""
        if self._skip(name):
            return
        try:
            before = read()
        except Exception:
            return
        self._readers.append((name, kind, read, before))

    def _add_namespace(
        self, prefix: str, kind: str, namespace: dict, keys: list[str], module: types.ModuleType | None = None
    ) -> None:
        """Watch ``namespace[key]`` (a module's or a class's dict) for each key holding a plain value, a function
        or a class; a key that leaves a ``module``'s dict is read as other modules read it (``module.key``)."""
        containers = kind == "object attribute"
        keys = [k for k in keys if not self._skip(f"{prefix}.{k}") and _key_of(namespace.get(k), containers) != _OTHER]
        if keys:
            self._namespaces.append(_Namespace(prefix, kind, namespace, keys, module))

    def _skip(self, name: str) -> bool:
        if not self.ignore_benign:
            return False
        last = name.rsplit(".", 1)[-1].lower()
        return any(word in last for word in _COUNTER_WORDS) or _BENIGN.match(name) is not None

    def _add_new_modules(self) -> None:
        """The globals and classes of every ``torch`` module loaded since the last look."""
        for module_name, module in list(sys.modules.items()):
            if module_name in self._seen_modules or module_name.split(".")[0] != "torch" or module is None:
                continue
            if getattr(getattr(module, "__spec__", None), "_initializing", False):
                continue  # still being imported: its names are not settled yet (looked at again later)
            self._seen_modules.add(module_name)
            namespace = vars(module)
            # torchfix's fast-read switches: the moved globals themselves are watched as other modules read them
            internal = fast_read_globals(module)
            names = [name for name in list(namespace) if not name.startswith("__") and name not in internal]
            self._add_namespace(module_name, "module global", namespace, names, module)
            for name in names:
                value = namespace.get(name)
                kind = type(value)
                if issubclass(kind, type) and vars(value).get("__module__") == module_name:
                    attrs = vars(value)  # a class's own attributes, and the special methods torch patches
                    watched = [a for a in list(attrs) if not a.startswith("__") or a in _PATCHED_SPECIAL_METHODS]
                    self._add_namespace(f"{module_name}.{name}", "class attribute", attrs, watched)
                elif _is_torch_object(value) and id(value) not in self._seen_objects:
                    self._seen_objects.add(id(value))  # one object held by several modules is watched once
                    attrs = _own_dict(value)  # an object's own attributes: a module-level singleton's state
                    watched = [a for a in list(attrs) if not a.startswith("__")]
                    self._add_namespace(f"{module_name}.{name}", "object attribute", attrs, watched)

    def _add_switches(self) -> None:
        torch_c = sys.modules["torch"]._C
        for name in dir(torch_c):
            getter = getattr(torch_c, name, None)
            if name.startswith("_get_") and callable(getter):
                self._add(f"torch._C.{name}()", "C++ switch", _plain_call(getter))
        self._switches = list(self._readers)

    def _add_python_kernels(self) -> None:
        """The Python kernels of every overload of torch's own operators (made here if torch had not yet: a later
        one's first kernels could already be another thread's temporary ones)."""
        ops = sys.modules["torch"].ops
        for namespace_name in ("aten", "prims"):
            namespace = getattr(ops, namespace_name)
            for packet_name in list(namespace):
                packet = getattr(namespace, packet_name, None)
                for overload_name in getattr(packet, "overloads", list)():
                    overload = getattr(packet, overload_name, None)
                    if hasattr(overload, "py_kernels"):
                        self._add(str(overload), "python kernels", _kernels_of(overload))

    # Sampling ------------------------------------------------------------------------------------------------

    def start(self, background: bool = True) -> Watcher:
        """Note every watched name's value now and, with ``background``, sample from a thread of its own until
        :meth:`stop` (without, the caller samples: :meth:`sample`, from a thread that does no work)."""
        if "torch" not in sys.modules:
            raise RuntimeError("import torch before watching it")
        self._add_switches()
        self._add_new_modules()
        self._add_python_kernels()
        if background:
            self._thread = threading.Thread(target=self._run, name="torchfix-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> dict[str, Change]:
        """Stop sampling, after one last sample of everything (what is still changed at the end shows so)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample(everything=True)
        return self.changes

    def _run(self) -> None:
        looked = len(sys.modules)
        while not self._stop.wait(self.interval):
            started = time.perf_counter()
            if len(sys.modules) != looked:  # a module imported meanwhile: watch it from now on
                looked = len(sys.modules)
                self._add_new_modules()
            self.sample()
            self.sample_seconds += time.perf_counter() - started

    def sample(self, everything: bool = False) -> None:
        """Read every watched name once (the operators' kernels at every KERNELS_EVERY-th sample, or with
        ``everything``) and note what differs from its value at the start."""
        self.samples += 1
        self._stacks = None
        readers = self._readers if everything or self.samples % KERNELS_EVERY == 1 else self._switches
        differ: set[str] = set()
        for group in self._namespaces:
            for name, before, now in group.differing():  # before: its key at the start
                now = _key_of(now, group.containers)
                if now != before:  # else another object that is the same for this thread (a dispatcher)
                    self._differs(name, group.kind, before, now)
                    differ.add(name)
        for name, kind, read, before in readers:
            try:
                now = read()
            except Exception:
                differ.add(name)  # unread: not taken as restored
                continue
            if now != before:
                self._differs(name, kind, before, now)
                differ.add(name)
        read_now = {name for name, *_ in readers}
        for name, change in self.changes.items():
            if name not in differ and (change.kind not in ("python kernels", "C++ switch") or name in read_now):
                change.restored = True

    def _differs(self, name: str, kind: str, before: object, now: object) -> None:
        change = self.changes.get(name)
        if change is None:
            if self._stacks is None:  # one look at the other threads per sample
                self._stacks = _other_threads_stacks()
            change = self.changes[name] = Change(name, kind, before, stacks=self._stacks)
        change.samples += 1
        if not change.seen or change.seen[-1] != now:
            change.seen.append(now)

    def report(self) -> dict:
        """What the watcher saw: new changes first, set-and-restored before the rest (temporary process-wide
        settings); each change's ``known`` is why it was triaged (:data:`DECLARED`), or None where it is new."""
        from .._fix import State
        from .._install import status

        applied = {entry.name for entry in status() if entry.state in (State.APPLIED, State.PENDING)}
        changes = [dict(c.describe(), known=known_reason(c.name, applied)) for c in self.changes.values()]
        changes.sort(key=lambda c: (c["known"] is not None, not c["restored"], c["kind"], c["name"]))
        return {
            "samples": self.samples,
            "probes": sum(len(g.keys) for g in self._namespaces) + len(self._readers),
            "sampling_seconds": round(self.sample_seconds, 3),
            "new": sum(c["known"] is None for c in changes),
            "changes": changes,
        }


_DELETED = object()
_PATCHED_SPECIAL_METHODS = ("__call__", "__getattr__", "__getattribute__")  # what torch's tracers patch on classes


class _Namespace:
    """Watched keys of one dict (a module's, a class's, an object's), with their values at the start, read in one C
    call."""

    def __init__(
        self, prefix: str, kind: str, namespace: dict, keys: list[str], module: types.ModuleType | None
    ) -> None:
        self.prefix, self.kind, self.namespace, self.keys, self.module = prefix, kind, namespace, keys, module
        self.containers = kind == "object attribute"  # an object's lists and dicts are compared by their length
        self._read = operator.itemgetter(*keys)  # one key: the value; several: a tuple of them
        self._before = self._read(namespace)
        befores = self._before if len(keys) > 1 else (self._before,)
        self._before_keys = [_key_of(value, self.containers) for value in befores]

    def differing(self) -> Iterator[tuple[str, object, object]]:
        """(name, key of the value at the start, value now) of each key whose value is not the one it was."""
        try:
            now = self._read(self.namespace)
            if now is self._before or now == self._before:  # a tuple compares by identity first, then ==
                return
        except Exception:  # a key deleted, or a value whose == raises (a tensor where None was)
            pass
        befores = self._before if len(self.keys) > 1 else (self._before,)
        for key, before, before_key in zip(self.keys, befores, self._before_keys):
            now = self.namespace.get(key, _DELETED)
            if now is _DELETED and self.module is not None:  # moved out (torchfix's per-thread globals, PEP 562)
                now = getattr(self.module, key, _DELETED)
            if now is not before and not _same(now, before):
                yield f"{self.prefix}.{key}", before_key, now


def _is_torch_object(value: object) -> bool:
    """An instance of a class of torch's (not a class, function or module) with attributes of its own."""
    kind = type(value)
    if issubclass(kind, (type, types.ModuleType, types.FunctionType, threading.local)):
        return False
    try:
        return kind.__module__.split(".")[0] == "torch" and type(_own_dict(value)) is dict
    except AttributeError:  # no __dict__
        return False


def _own_dict(value: object) -> dict:
    """``vars(value)`` without the class's ``__getattribute__`` (a deprecated object's warns)."""
    return object.__getattribute__(value, "__dict__")


def _same(now: object, before: object) -> bool:
    """Whether a slot holds what it held: the same object, or an equal plain value (NaN equal to NaN)."""
    if type(now) is not type(before) or type(now) not in _PLAIN:
        return False
    return now == before or now != now and before != before


def _plain_call(getter: Callable[[], object]) -> Callable[[], object]:
    def read() -> object:
        value = getter()
        if type(value) not in _PLAIN:
            raise TypeError("not a plain value")
        return value

    return read


def _kernels_of(overload: object) -> Callable[[], object]:
    def read() -> object:
        kernels = getattr(overload, "py_kernels", {})
        return frozenset((key, id(fn)) for key, fn in list(kernels.items()))

    return read


def _other_threads_stacks() -> dict[str, list[str]]:
    """The innermost frames of every thread but the watcher's, as ``file:line in function``."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    stacks = {}
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        summary = traceback.extract_stack(frame)[-12:]
        stacks[names.get(ident, str(ident))] = [f"{f.filename}:{f.lineno} in {f.name}" for f in summary]
    return stacks


@contextlib.contextmanager
def watch(interval: float = 0.02) -> Iterator[Watcher]:
    """Watch torch's process state while the block runs: ``with torchfix.watch() as w: ...; w.report()``."""
    watcher = Watcher(interval).start()
    try:
        yield watcher
    finally:
        watcher.stop()


def main(target: list[str], interval: float, output: str | None) -> int:
    """``python -m torchfix watch [--interval S] [--json FILE] -- script.py args`` (or ``-m module args``)."""
    import runpy

    import torch  # noqa: F401  (the watcher needs it first)

    if not target:
        print("usage: python -m torchfix watch [--interval S] [--json FILE] -- script.py [args...]", file=sys.stderr)
        return 2
    watcher = Watcher(interval).start()
    status = 0
    try:
        if target[0] == "-m":
            sys.argv = target[1:]
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = target
            runpy.run_path(target[0], run_name="__main__")
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        watcher.stop()
    report = watcher.report()
    if output:
        with open(output, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    _print(report)
    return status


def _print(report: dict) -> None:
    changes = report["changes"]
    print(
        f"\ntorchfix watch: {report['samples']} samples of {report['probes']} names "
        f"({report['sampling_seconds']} s sampling); {len(changes)} changed, {report['new']} of them new",
        file=sys.stderr,
    )
    for change in changes:
        if change["known"] is not None:
            print(f"  {'known':22} {change['kind']:16} {change['name']}: {change['known']}", file=sys.stderr)
            continue
        state = "set and restored" if change["restored"] else "changed, not restored"
        print(
            f"  {state:22} {change['kind']:16} {change['name']}: {change['before']!r} -> {change['seen']!r}",
            file=sys.stderr,
        )
        for thread, frames in change["stacks"].items():
            torch_frames = [f for f in frames if "/torch/" in f][-3:]
            if torch_frames:
                print(f"  {'':22}   {thread}: {' < '.join(reversed(torch_frames))}", file=sys.stderr)
