"""All-gather and reduce-scatter times per FSDP module, measured in isolation with every rank together."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from runtime import torch_private
from runtime.measure import synchronize


def _median_ms(run: Callable[[], None], after: Callable[[], None], repeats: int, device: str,
               before: Callable[[], None] = lambda: None) -> float:
    """Median wall time of ``run`` in ms over ``repeats`` (one extra warm-up dropped), each after ``before`` (untimed)
    and a barrier, each followed by ``after`` (untimed)."""
    times = []
    for _ in range(repeats + 1):
        before()
        dist.barrier()
        synchronize(device)
        t0 = time.perf_counter()
        run()
        synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
        after()
    return statistics.median(times[1:])


def all_gather_ms(modules: list[tuple[str, FSDPModule]], repeats: int, device: str) -> dict[str, float]:
    """Per FSDP module: one ``module.unshard()`` (all-gather + copy-out) after a barrier, ms (median)."""
    return {fqn: _median_ms(m.unshard, m.reshard, repeats, device) for fqn, m in modules}


def reduce_scatter_ms(module: FSDPModule, repeats: int, device: str) -> float:
    """One reduce-scatter of an FSDP module's gradients as its post-backward runs it, ms (median).

    FSDP2's own ``foreach_reduce`` (:func:`runtime.torch_private.reduce_scatter_gradients`): the ``chunk_cat`` of
    the unsharded gradients into a fresh input, the collective, the sharded gradients in a fresh output; the
    gradients are made before the barrier, untimed, as backward makes them. 0 for a module without trainable
    parameters of its own (FSDP2's post-backward returns before any reduce-scatter). A module whose sharded
    parameters have post-accumulate-grad hooks (the reduce-scatter would run them): a bare reduce-scatter of the
    same numel on preallocated buffers instead, which leaves the copy-in and the fresh memory out.
    """
    grads = torch_private.unsharded_gradients(module)
    if not grads:
        return 0.0
    if torch_private.has_post_accumulate_grad_hooks(module):
        return _bare_reduce_scatter_ms(sum(g.numel() for g in grads), grads[0].dtype, repeats, device)
    pending: list[list[torch.Tensor]] = []

    def make() -> None:
        pending[:] = [torch_private.unsharded_gradients(module)]

    return _median_ms(lambda: torch_private.reduce_scatter_gradients(module, pending[0]), pending.clear, repeats,
                      device, before=make)


def _bare_reduce_scatter_ms(numel: int, dtype: torch.dtype, repeats: int, device: str) -> float:
    """One reduce-scatter of ``numel`` elements of ``dtype`` (padded as FSDP2 pads) on preallocated buffers, ms."""
    world = dist.get_world_size()
    padded = -(-numel // world) * world
    inp = torch.zeros(padded, dtype=dtype, device=device)
    out = torch.empty(padded // world, dtype=dtype, device=device)
    # reduce_scatter_single replaces the deprecated reduce_scatter_tensor in newer torch
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return _median_ms(lambda: reduce_scatter(out, inp), lambda: None, repeats, device)
