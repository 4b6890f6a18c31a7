"""Workload factories that are wrong on purpose, or slowed on purpose (imported by rank processes)."""

import torch

from runtime.workload import Workload


def raises(mesh, **kwargs):
    raise RuntimeError("out of coffee")


def unwrapped(mesh, **kwargs):
    model = torch.nn.Linear(4, 4)
    return Workload(
        model, torch.optim.SGD(model.parameters(), lr=0.1), lambda s: torch.ones(2, 4), lambda m, b: m(b).sum()
    )


def deep_prefetch_fails_on_rank1(mesh, first_attempt_only=False, survivor_hangs=False, **kwargs):
    """The test MLP, but rank 1 raises inside a forward whenever explicit forward prefetch is on, or the first
    block keeps its parameters unsharded after forward (both hold more memory).

    Stands in for a rank-specific failure in the middle of a step (an
    out-of-memory error on one GPU under a deeper prefetch): the raise comes
    after the second block's all-gather, so rank 0 goes on into the next
    all-gather and waits there for rank 1. With ``first_attempt_only``, only
    in torchrun's first attempt (``TORCHELASTIC_RESTART_COUNT`` 0): a
    transient fault that a restart gets past. With ``survivor_hangs``, rank 0 waits at the same place in a fake
    collective that never returns (NCCL's, before its watchdog's timeout): only the project's own bound ends it.
    """
    import os
    import threading

    from runtime.reference_workloads import mlp

    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0

    workload = mlp(mesh, **kwargs)
    blocks = workload.model.blocks
    configured = {"depth": 0, "kept": False}
    setter, reshard_setter = blocks[0].set_modules_to_forward_prefetch, blocks[0].set_reshard_after_forward

    def set_forward_prefetch(modules):
        configured["depth"] = len(modules)
        setter(modules)

    def set_reshard_after_forward(reshard, **kwargs):
        configured["kept"] = not reshard
        reshard_setter(reshard, **kwargs)

    blocks[0].set_modules_to_forward_prefetch = set_forward_prefetch
    blocks[0].set_reshard_after_forward = set_reshard_after_forward

    def fail(module, args):
        memory_hungry = configured["depth"] >= 1 or configured["kept"]
        if mesh.get_rank() == 1 and memory_hungry and not (first_attempt_only and restarted):
            raise RuntimeError("CUDA out of memory (simulated on rank 1)")
        if mesh.get_rank() == 0 and memory_hungry and survivor_hangs:
            threading.Event().wait()

    blocks[1].register_forward_pre_hook(fail)
    return workload


def mlp_slow_default(mesh, slow_ms=20.0, **kwargs):
    """The test MLP whose steps under FSDP2's default each take ``slow_ms`` more (a sleep before the root's forward,
    on every rank): every other plan is faster by far more than the noise, so a tuning job's outcome is the test's,
    not the machine's (its race keeps a survivor, its confirmation finds it faster)."""
    import time

    from runtime.current import current_plan, fsdp2_default
    from runtime.reference_workloads import mlp

    workload = mlp(mesh, **kwargs)
    model = workload.model
    default = fsdp2_default(model).behaviour_key()

    def slower_under_the_default(module, args):
        if current_plan(model).behaviour_key() == default:
            time.sleep(slow_ms / 1000)

    model.register_forward_pre_hook(slower_under_the_default)
    return workload
