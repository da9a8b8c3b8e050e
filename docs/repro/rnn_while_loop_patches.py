"""Survey repro: torch.export._patches' LSTM/GRU while_loop decomposition is process-wide (torch 2.11+).

    python docs/repro/rnn_while_loop_patches.py [--torchfix]

``register_lstm_while_loop_decomposition()`` (entered by every ``torch.onnx.export(..., dynamo=True)`` with dynamic
shapes) writes ``aten.lstm.input.py_kernels[CompositeImplicitAutograd]`` and the post-autograd decomposition table
for the whole process, then restores what it saved. Forced with events, no sleeps:

1. while thread A is inside the context, the main thread's ``run_decompositions()`` of an LSTM program it exported
   before decomposes with A's while_loop kernel (on 2.13 it then fails: ``SpecViolationError``);
2. two threads inside, the first in leaving first: the second restores the first's kernel, so it stays installed,
   and every later ``run_decompositions()`` of an LSTM program in the process takes it.
"""

import sys
import threading

if "--torchfix" in sys.argv:
    import torchfix  # noqa: F401

import torch
from torch._decomp import global_decomposition_table
from torch.export._patches import register_lstm_while_loop_decomposition

OP, CIA = torch.ops.aten.lstm.input, torch._C.DispatchKey.CompositeImplicitAutograd


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(4, 8)

    def forward(self, x):
        return self.lstm(x)[0]


PROGRAM = torch.export.export(Model(), (torch.randn(3, 2, 4),))  # aten.lstm is kept until run_decompositions


def decomposed() -> str:
    """How the main thread's run_decompositions() of the LSTM program turns out."""
    try:
        graph = PROGRAM.run_decompositions().graph
    except Exception as error:  # noqa: BLE001 - the outcome is the point
        return f"raised {type(error).__name__}: {str(error)[:80]}"
    return "while_loop" if any("while_loop" in str(node.target) for node in graph.nodes) else "unrolled (torch's own)"


def inside(entered: threading.Event, leave: threading.Event, left: threading.Event | None = None) -> None:
    with register_lstm_while_loop_decomposition():
        entered.set()
        leave.wait(60)
    if left is not None:
        left.set()


def state() -> str:
    kernel = OP.py_kernels.get(CIA)
    table = global_decomposition_table["post_autograd"].get(OP)
    return f"py_kernels[CIA]={getattr(kernel, '__name__', kernel)}, table={getattr(table, '__name__', table)}"


print("torch", torch.__version__, "torchfix" if "torchfix" in sys.modules else "without torchfix")
print("before:", state(), "| run_decompositions:", decomposed())

entered, leave = threading.Event(), threading.Event()
a = threading.Thread(target=inside, args=(entered, leave))
a.start()
entered.wait(60)
print("1. while A is inside: the main thread's run_decompositions:", decomposed())
leave.set()
a.join(60)

(e1, l1, d1), (e2, l2, d2) = [(threading.Event(), threading.Event(), threading.Event()) for _ in range(2)]
first = threading.Thread(target=inside, args=(e1, l1, d1))
second = threading.Thread(target=inside, args=(e2, l2, d2))
first.start()
e1.wait(60)
second.start()
e2.wait(60)
l1.set()
d1.wait(60)  # the first in leaves first
l2.set()
d2.wait(60)
first.join(60)
second.join(60)
print("2. after two overlapping contexts:", state(), "| run_decompositions:", decomposed())
