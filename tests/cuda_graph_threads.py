"""N threads train their own attention block compiled with ``mode="reduce-overhead"`` (CUDA graphs) on
one device, every step checked against an eager twin; cold compile caches.

    python tests/cuda_graph_threads.py [--threads 3] [--steps 40] [--generations 1] [--mark-step] [--mlp]
                                       [--timeout 300]

Each thread trains a compiled block and an eager copy with the same weights, inputs and optimizer, and
compares the two outputs and weights after every step: a thread whose CUDA graphs were replayed or
overwritten by another thread's sees them differ, or torch raises ("accessing tensor output of CUDAGraphs
that has been overwritten by a subsequent run", capture errors). ``--mark-step`` calls
``torch.compiler.cudagraph_mark_step_begin()`` before each step, as training loops with CUDA graphs do.
``--generations G``: G rounds of threads, one after the other; each round's threads go on training the same
blocks for ``--steps`` steps (in CUDA graph trees of their own) and end, as the workers of a job that starts
threads per phase do. Meanwhile the main thread runs Python (it builds small modules), as a job's main
thread does. ``--mlp`` trains a two-layer MLP instead of the attention block (it compiles in seconds, so
many generations fit in a run). TORCHFIX_DISABLE turns fixes off (the cudagraph-* ones one at a time to
see what each removes). Prints one JSON line: steps each thread finished, the first error of each, the
largest differences from eager, hung threads; exit code 0 when every thread finished every step equal to
eager.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import threading
import time
import traceback


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--generations", type=int, default=1)
    parser.add_argument("--mark-step", action="store_true")
    parser.add_argument("--mlp", action="store_true")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    faulthandler.enable()  # a crash inside torch prints every thread's Python stack
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import torchfix  # noqa: F401  (TORCHFIX_DISABLE turns fixes off)

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    heads, seq, dim = 4, 256, 32
    causal = create_block_mask(lambda b, h, q, kv: q >= kv, B=None, H=None, Q_LEN=seq, KV_LEN=seq, device="cuda")

    class Block(torch.nn.Module):
        """Causal self-attention: flex attention where compiled, dense SDPA (the same function) in the eager
        twin, so that the reference is plain eager code."""

        def __init__(self, flex: bool) -> None:
            super().__init__()
            self.flex = flex
            self.qkv = torch.nn.Linear(heads * dim, 3 * heads * dim)
            # --mlp: qkv is the hidden layer, its whole width goes to `out`
            self.out = torch.nn.Linear((3 if args.mlp else 1) * heads * dim, heads * dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if args.mlp:
                return self.out(torch.nn.functional.gelu(self.qkv(x)))
            b = x.shape[0]
            q, k, v = self.qkv(x).view(b, seq, 3, heads, dim).permute(2, 0, 3, 1, 4)
            if self.flex:
                attended = flex_attention(q, k, v, block_mask=causal)
            else:
                attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out(attended.transpose(1, 2).reshape(b, seq, heads * dim))

    start = time.perf_counter()
    done: dict[str, int] = {}
    errors: dict[str, str] = {}
    worst: dict[str, float] = {}
    models = []
    for index in range(args.threads):  # made once: later generations go on training them
        torch.manual_seed(index)  # each thread its own weights and data: a mix-up shows as a difference
        eager = Block(flex=False).cuda()
        compiled_block = Block(flex=True).cuda()
        compiled_block.load_state_dict(eager.state_dict())
        # Data from a generator of the thread's own, as from a loader: drawing from the device's default
        # generator while another thread captures a CUDA graph raises "Offset increment outside graph
        # capture" (the default generator is in capture mode for every thread; torch, not torchfix).
        data = torch.Generator(device="cuda").manual_seed(index)
        models.append((eager, compiled_block, torch.compile(compiled_block, mode="reduce-overhead"), data))
        done[f"t{index}"], worst[f"t{index}"] = 0, 0.0

    def worker(index: int) -> None:
        name = f"t{index}"
        eager, compiled_block, compiled, data = models[index]
        try:
            opt_eager = torch.optim.SGD(eager.parameters(), lr=0.05)
            opt_compiled = torch.optim.SGD(compiled_block.parameters(), lr=0.05)
            for _ in range(args.steps):
                if args.mark_step:
                    torch.compiler.cudagraph_mark_step_begin()
                x = torch.randn(2, seq, heads * dim, device="cuda", generator=data)
                out = compiled(x)
                ref = eager(x)
                out.square().mean().backward()
                ref.square().mean().backward()
                opt_compiled.step()
                opt_eager.step()
                opt_compiled.zero_grad()
                opt_eager.zero_grad()
                diff = max(
                    (out - ref).abs().max().item(),
                    *((a - b).abs().max().item() for a, b in zip(compiled_block.parameters(), eager.parameters())),
                )
                worst[name] = max(worst[name], diff)
                if diff > 1e-3:
                    raise AssertionError(f"step {done[name]}: differs from eager by {diff:.3g}")
                done[name] += 1
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc) else ''}"
            traceback.print_exc()

    deadline = start + args.timeout
    hung: list[str] = []
    for _ in range(args.generations):
        threads = [threading.Thread(target=worker, args=(i,), name=f"t{i}", daemon=True) for i in range(args.threads)]
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads) and time.perf_counter() < deadline:
            [list(torch.nn.Linear(4, 4).parameters()) for _ in range(20)]  # the main thread's own Python work
        hung = [thread.name for thread in threads if thread.is_alive()]
        if hung or errors:
            break
    if hung:
        faulthandler.dump_traceback(all_threads=True)
    report = {
        "torch": torch.__version__,
        "disabled": os.environ.get("TORCHFIX_DISABLE", ""),
        "model": "mlp" if args.mlp else "attention",
        "mark_step": args.mark_step,
        "generations": args.generations,
        "steps_done": done,
        "errors": errors,
        "max_diff": {name: float(f"{value:.3g}") for name, value in worst.items()},
        "hung": hung,
        "wall_s": round(time.perf_counter() - start, 1),
        "torchfix": [f"{s.name}: {s.state.value}" for s in sys.modules["torchfix"].status()],
    }
    print(json.dumps(report), flush=True)
    ok = not hung and not errors and all(n == args.steps * args.generations for n in done.values())
    os._exit(0 if ok else 3 if hung else 1)  # threads stuck in a deadlock never finish: do not wait


if __name__ == "__main__":
    main()
