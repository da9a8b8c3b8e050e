"""Survey repro: ``torch._numpy._util._coerce_to_tensor`` flips the process's default dtype while Dynamo traces NumPy.

    python docs/repro/numpy_default_dtype.py [--torchfix]

It saves ``torch.get_default_dtype()``, sets the NumPy default (float64), converts, and restores. Thread A compiles a
function calling ``np.array`` of a Python list; a line-trace hook on thread A holds it at the conversion, after the
switch (torch is not mocked). Meanwhile the main thread makes a tensor.
"""

import sys
import threading

if "--torchfix" in sys.argv:
    import torchfix  # noqa: F401

import numpy as np
import torch
import torch._numpy._util as util

held, release = threading.Event(), threading.Event()
LINE = next(i for i, text in enumerate(open(util.__file__), 1) if "tensor = _try_convert_to_tensor(obj)" in text)


def hook(frame, event, arg):
    if frame.f_code.co_filename == util.__file__ and event == "line" and frame.f_lineno == LINE and not held.is_set():
        held.set()
        release.wait(60)
    return hook


@torch.compile(backend="eager")
def f(x):
    return x + torch.from_numpy(np.array([1.5, 2.5]))


def compile_in_a_thread() -> None:
    sys.settrace(hook)
    f(torch.zeros(2, dtype=torch.float64))
    sys.settrace(None)


print("torch", torch.__version__, "torchfix" if "torchfix" in sys.modules else "without torchfix")
a = threading.Thread(target=compile_in_a_thread)
a.start()
if held.wait(120):
    print("while thread A compiles np.array([...]): the main thread's torch.ones(1).dtype =", torch.ones(1).dtype)
else:
    print("thread A never reached the conversion")
release.set()
a.join(120)
print("after: default dtype", torch.get_default_dtype())
