"""Measured peak memory of one training step, per rank.

What the simulator predicts as ``SimResult.peak_bytes``: the most bytes of
tensors alive at once during a step, on this rank.

- GPU: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``
  (and ``max_memory_reserved``, which the caching allocator adds on top).
- CPU: there is no allocator peak to read, so the step runs under
  ``torch.profiler.profile(profile_memory=True)``. Its allocation events carry
  the running total of bytes allocated while profiling
  (:func:`runtime.ranks.torch_private.profiler_allocations`); their peak above the
  total at step start is the step's own peak. Added to it: the bytes alive at
  step start, counted from their storages (the sharded parameters, their
  gradients if any and the optimizer state; each storage once), counted after
  ``zero_grad(set_to_none=True)``, which ``train_step`` runs first. Memory outside
  tensors (gloo's buffers, the interpreter) is not counted, on either device.

The profiler slows the step, so a measured-peak step is never a timed one.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from runtime.ranks.device import device_of
from runtime.ranks.torch_private import profiler_allocations
from runtime.timing import device_type_of
from runtime.workload import Workload, forward_backward

# A plan's measured peak is the median over this many steps of the max across ranks (peak_of_steps): on CPU
# some steps of the same plan peak one block's unsharded bytes higher than most, on either rank, whatever the
# garbage collector does. They are gloo's copies of the reduce-scatter input (c10d::_reduce_scatter_base_ ->
# aten::clone, one block's unsharded gradient each): a few may be alive at a peak, most freed at the next block's
# post-backward and some later, so a single step's peak is not the plan's.
PEAK_STEPS = 3
OPTIMIZER_BLOCK = "prefetch-planner: optimizer.step"  # the record_function around the optimizer step


@dataclass(frozen=True)
class PeakMemory:
    """One rank's peak in one step, bytes.

    Attributes:
        peak_bytes: the most tensor bytes alive at once (CPU: alive at step
            start + the step's own peak; GPU: ``max_memory_allocated``).
        start_bytes: tensor bytes alive at step start.
        optimizer_temp_bytes: what ``optimizer.step()`` allocated above what
            was alive when it started, at its peak (its temporaries).
        reserved_bytes: GPU: ``max_memory_reserved``; CPU: ``None``.
    """

    peak_bytes: int
    start_bytes: int
    optimizer_temp_bytes: int
    reserved_bytes: int | None = None


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def bytes_alive(model: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes of ``model``'s parameters, their gradients and the ``optimizers``' state alive now (each storage
    once)."""
    tensors: list[torch.Tensor] = []
    for p in model.parameters():
        tensors.append(p)
        if p.grad is not None:
            tensors.append(p.grad)
    for optimizer in optimizers:
        for state in optimizer.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return storage_bytes(tensors)


def step_peak(allocations: list[tuple[int, int, int]]) -> int:
    """The step's own peak from :func:`runtime.ranks.torch_private.profiler_allocations`, bytes above the total at its
    start.

    The total before the first event is its total minus its size; frees of
    tensors allocated before profiling are not counted by the profiler, so
    the peak is never below 0.
    """
    if not allocations:
        return 0
    start = allocations[0][2] - allocations[0][1]
    return max(0, max(total for _, _, total in allocations) - start)


def peak_of_steps(per_rank: list[list[int]]) -> int:
    """A plan's measured peak, bytes: the median over steps of the max across ranks.

    Args:
        per_rank: ``per_rank[r][s]``: rank ``r``'s peak in step ``s``.
    """
    return int(statistics.median_low([max(step) for step in zip(*per_rank, strict=True)]))


# [Note: Kineto's start and stop lines]
# The profiler's C++ side (kineto, torch 2.13) writes "USDT: ... profiler_start"
# and "profiler_stop" to the process's stderr on every start and stop, with no
# setting to turn them off; a tuning job measures peaks on every rank for
# every plan, and those lines buried its report. Only the start and stop
# calls run with file descriptor 2 pointed at /dev/null; the step itself
# writes to stderr as usual.


@contextlib.contextmanager
def stderr_silenced() -> Iterator[None]:
    """File descriptor 2 (C++ code's stderr too) goes to /dev/null inside the block; restored on leaving."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def measure_peak(workload: Workload, step: int) -> PeakMemory:
    """Run training step ``step`` and measure this rank's peak.

    The step is ``runtime.workload.train_step``'s (``zero_grad(set_to_none=True)``,
    ``forward_backward`` (every microbatch), ``optimizer.step()``),
    written out so that the optimizer step's own peak is read apart. All
    ranks call this together (the step runs collectives).
    """
    device = device_of(device_type_of(workload))
    optimizer = workload.optimizer
    optimizer.zero_grad(set_to_none=True)
    device.synchronize()
    if device.type == "cuda":
        device.reset_peak()
        start = device.allocated()
        forward_backward(workload, step)
        device.synchronize()
        peak, before, reserved = device.peak_allocated(), device.allocated(), device.peak_reserved()
        device.reset_peak()
        optimizer.step()
        device.synchronize()
        optimizer_peak = device.peak_allocated()
        return PeakMemory(max(peak, optimizer_peak), start, optimizer_peak - before,
                          max(reserved, device.peak_reserved()))
    start = bytes_alive(workload.model, [optimizer])
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with stderr_silenced():  # [Note: Kineto's start and stop lines]
        prof.__enter__()
    try:
        forward_backward(workload, step)
        with record_function(OPTIMIZER_BLOCK):
            optimizer.step()
    finally:
        with stderr_silenced():
            prof.__exit__(None, None, None)
    return PeakMemory(start + step_peak(profiler_allocations(prof)), start,
                      step_peak(profiler_allocations(prof, within=OPTIMIZER_BLOCK)))
