"""Survey repro: ``torch.nn.utils.parametrize.cached()`` switches the parametrization cache on for every thread.

    python docs/repro/parametrize_cached.py [--torchfix]

``cached()`` counts its entries in a module global and keeps the cache in another (keyed by module id and tensor
name). While thread A is inside (e.g. an RNN loop, as its docstring suggests), the main thread trains a module of
its own with a parametrization: its second step reads the weight cached at its first. Forced with events.
"""

import sys
import threading

if "--torchfix" in sys.argv:
    import torchfix  # noqa: F401

import torch
import torch.nn.utils.parametrize as P


class Double(torch.nn.Module):
    def forward(self, w):
        return 2 * w


def two_steps() -> str:
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 3)
    P.register_parametrization(layer, "weight", Double())
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.ones(2, 3)
    try:
        for _ in range(2):
            opt.zero_grad()
            layer(x).sum().backward()
            opt.step()
    except RuntimeError as error:
        return f"raised RuntimeError: {str(error)[:70]}"
    return f"ok, weight sum {layer.weight.sum().item():.4f}"


print("torch", torch.__version__, "torchfix" if "torchfix" in sys.modules else "without torchfix")
print("alone:", two_steps())
entered, leave = threading.Event(), threading.Event()


def inside() -> None:
    with P.cached():
        entered.set()
        leave.wait(60)


a = threading.Thread(target=inside)
a.start()
entered.wait(60)
print("while another thread is inside parametrize.cached():", two_steps())
leave.set()
a.join(60)
