"""Survey check: which C++ switches that torch's Python code sets are per thread and which are process-wide.

    python docs/repro/switch_scope.py

Each switch is set in a new thread and read in the main thread afterwards, then put back.
"""

import threading

import torch

C = torch._C
SWITCHES = {  # name: (setter, getter, the value to set; None: the opposite of the current bool)
    "grad layout enforcement": (C._set_grad_layout_enforcement_enabled, C._is_grad_layout_enforcement_enabled, None),
    "autograd multithreading": (C._set_multithreading_enabled, C._is_multithreading_enabled, None),
    "view replay": (C._set_view_replay_enabled, C._is_view_replay_enabled, None),
    "forward grad": (C._set_fwd_grad_enabled, C._is_fwd_grad_enabled, None),
    "functorch inplace_requires_grad": (
        C._functorch.set_inplace_requires_grad_allowed,
        C._functorch.get_inplace_requires_grad_allowed,
        None,
    ),
    "meta in TLS dispatch include": (C._set_meta_in_tls_dispatch_include, C._meta_in_tls_dispatch_include, None),
    "autocast cache": (torch.set_autocast_cache_enabled, torch.is_autocast_cache_enabled, None),
    "anomaly mode": (torch.set_anomaly_enabled, torch.is_anomaly_enabled, None),
    "sparse invariants check": (C._set_check_sparse_tensor_invariants, C._check_sparse_tensor_invariants, None),
    "deterministic fill": (
        C._set_deterministic_fill_uninitialized_memory,
        C._get_deterministic_fill_uninitialized_memory,
        None,
    ),
    "default dtype": (torch.set_default_dtype, torch.get_default_dtype, torch.float64),
    "dynamo C recursion limit": (
        C._dynamo.eval_frame.set_c_recursion_limit,
        C._dynamo.eval_frame.get_c_recursion_limit,
        1234,
    ),
    "opt_einsum strategy": (
        lambda value: setattr(torch.backends.opt_einsum, "strategy", value),
        lambda: torch.backends.opt_einsum.strategy,
        "greedy",
    ),
}

print("torch", torch.__version__)
for name, (setter, getter, value) in SWITCHES.items():
    before = getter()
    value = (not before) if value is None else value
    thread = threading.Thread(target=setter, args=(value,))
    thread.start()
    thread.join()
    seen = getter()
    print(f"{name}: {'process-wide' if seen == value != before else 'per thread'}")
    setter(before)
