"""N threads train their own compiled flex-attention block on one CUDA device, cold compile caches.

    python tests/cuda_threaded_training.py [--threads 3] [--steps 3] [--timeout 240] [--no-torchfix]

This is the seeds' setup that hits H1 (a thread's compile traces while another thread's compiled call
checks the FX flag) and H5 (a lazily compiled backward on autograd's device thread waits for
compile_lock, held by a forward compile that waits for that same device thread). Prints one JSON line:
per-thread time to first step, errors, and whether it hung; on a hang, every thread's stack goes to
stderr and the exit code is 3. Set TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR to fresh folders: warm
caches hide both hazards.
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
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--no-torchfix", action="store_true")
    args = parser.parse_args()
    if args.no_torchfix:
        os.environ["TORCHFIX_DISABLE"] = "1"
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import torchfix  # noqa: F401  (the whole fix; TORCHFIX_DISABLE=1 makes it a no-op)

    heads, seq, dim = 4, 256, 64
    flex = torch.compile(flex_attention)
    causal = torch.compile(create_block_mask)(
        lambda b, h, q, kv: q >= kv, B=None, H=None, Q_LEN=seq, KV_LEN=seq, device="cuda"
    )

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(heads * dim, 3 * heads * dim)
            self.out = torch.nn.Linear(heads * dim, heads * dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b = x.shape[0]
            q, k, v = self.qkv(x).view(b, seq, 3, heads, dim).permute(2, 0, 3, 1, 4)
            return self.out(flex(q, k, v, block_mask=causal).transpose(1, 2).reshape(b, seq, heads * dim))

    start = time.perf_counter()
    first_step: dict[str, float] = {}
    errors: dict[str, str] = {}

    def worker(name: str) -> None:
        try:
            torch.manual_seed(0)
            block = torch.compile(Block().cuda())
            optimizer = torch.optim.AdamW(block.parameters(), lr=1e-3)
            for step in range(args.steps):
                x = torch.randn(2, seq, heads * dim, device="cuda")
                block(x).float().square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                torch.cuda.synchronize()
                if step == 0:
                    first_step[name] = round(time.perf_counter() - start, 2)
        except Exception:
            errors[name] = traceback.format_exc(limit=3)

    threads = [threading.Thread(target=worker, args=(f"t{i}",), name=f"t{i}", daemon=True) for i in range(args.threads)]
    for thread in threads:
        thread.start()
    deadline = start + args.timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.perf_counter()))
    hung = [thread.name for thread in threads if thread.is_alive()]
    report = {
        "torch": torch.__version__,
        "torchfix": [str(s) for s in sys.modules["torchfix"].status()],
        "threads": args.threads,
        "first_step_s": first_step,
        "errors": {name: text.strip().splitlines()[-1] for name, text in errors.items()},
        "hung": hung,
        "wall_s": round(time.perf_counter() - start, 1),
    }
    if hung:
        faulthandler.dump_traceback(all_threads=True)
    print(json.dumps(report), flush=True)
    # Threads stuck in a deadlock never finish: leave without waiting for them.
    os._exit(3 if hung else 1 if errors else 0)


if __name__ == "__main__":
    main()
