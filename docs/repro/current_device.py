"""Survey repro: ``torch.utils._device.CURRENT_DEVICE`` is one module global for the process.

    python docs/repro/current_device.py [--torchfix]

``torch.set_default_device(d)`` is per thread (its ``DeviceContext`` lives in a ``threading.local`` and on the
calling thread's torch-function mode stack), but its ``DeviceContext.__enter__`` / ``__exit__`` also set
``CURRENT_DEVICE``, which is not. Every Dynamo graph guards on ``CURRENT_DEVICE`` (``DEFAULT_DEVICE``), and the
mode-stack guard checks only the modes' types. Forced with events, no sleeps:

1. the main thread, which sets no default device, compiles again whenever another thread has set one: its graph's
   guard reads the other thread's device (no wrong result: another guard keeps each thread's graph its own);
2. two threads that set a default device and unset it in the order they set it leave ``CURRENT_DEVICE`` set for
   good.
"""

import sys
import threading

if "--torchfix" in sys.argv:
    import torchfix  # noqa: F401

import torch
import torch.utils._device as device_module

compiles = 0


def counting(gm, example_inputs):
    global compiles
    compiles += 1
    return gm


@torch.compile(backend=counting)
def make(x):
    return torch.ones(2) + x.sum().item()


def inside(device: str, entered: threading.Event, leave: threading.Event, left: threading.Event) -> None:
    torch.set_default_device(device)
    entered.set()
    leave.wait(60)
    torch.set_default_device(None)
    left.set()


def events() -> tuple[threading.Event, threading.Event, threading.Event]:
    return threading.Event(), threading.Event(), threading.Event()


print("torch", torch.__version__, "torchfix" if "torchfix" in sys.modules else "without torchfix")
x = torch.ones(1)
make(x)
make(x)
print("alone: graphs compiled", compiles)
for _ in range(3):
    entered, leave, left = events()
    other = threading.Thread(target=inside, args=("meta", entered, leave, left))
    other.start()
    entered.wait(60)
    device = make(x).device
    leave.set()
    other.join(60)
    make(x)
print(f"1. after 3 calls during another thread's set_default_device('meta'): graphs compiled {compiles}, {device}")

(e1, l1, d1), (e2, l2, d2) = events(), events()
first = threading.Thread(target=inside, args=("meta", e1, l1, d1))
second = threading.Thread(target=inside, args=("cpu", e2, l2, d2))
first.start()
e1.wait(60)
second.start()
e2.wait(60)
l1.set()
d1.wait(60)  # the first in leaves first
l2.set()
d2.wait(60)
print("2. after both threads unset theirs: CURRENT_DEVICE =", device_module.CURRENT_DEVICE)
