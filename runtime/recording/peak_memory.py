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
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.profiler import ProfilerActivity, profile, record_function

from runtime.ranks.device import device_of
from runtime.ranks.torch_private import profiler_allocations

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


class PeakMeter:
    """One rank's peak memory in one training step, bytes: the one meter of the tune job's and the in-loop tuner's
    peak steps (:class:`runtime.recording.steps.StepSide` begins and ends it around the step).

    CPU: the step runs under ``torch.profiler.profile(profile_memory=True)``; the peak is the bytes alive at its
    start (parameters, gradients, the state of ``optimizers``: :func:`bytes_alive`) plus the profiler's peak above
    that, and the optimizer steps run inside a ``record_function(OPTIMIZER_BLOCK)`` block (opened by a global
    optimizer pre-hook, ``register_optimizer_step_pre_hook``), whose own peak is the optimizer's temporaries. GPU:
    ``max_memory_allocated`` after ``reset_peak_memory_stats``, the peak read and reset again before the first
    optimizer step (the allocator's counters are the host's: no synchronization needed). Such a step is never a
    timed one. The profiler does not count frees of tensors allocated before it started, so a step whose
    gradients are freed inside it (``zero_grad`` first) starts with them freed (``runtime.recording.steps``).

    Args:
        model: the root FSDP module.
        optimizers: the optimizers whose state counts (a list the caller may keep filling).
    """

    def __init__(self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]):
        self.model, self.optimizers = model, optimizers
        self.device = device_of(next(model.parameters()).device.type)
        self.measuring = False
        self._prof: Any = None
        self._block: Any = None
        self._hooks: list[Any] = []
        self._start_bytes = 0
        self._before_optimizer: tuple[int, int, int] | None = None  # GPU: (peak, allocated, reserved) before it

    def begin(self) -> None:
        """Before the step."""
        self.measuring = True
        self._before_optimizer = None
        self.device.synchronize()
        self._hooks = [register_optimizer_step_pre_hook(self._optimizer_pre)]
        if self.device.type == "cuda":
            self.device.reset_peak()
            self._start_bytes = self.device.allocated()
            return
        self._start_bytes = bytes_alive(self.model, self.optimizers)
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with stderr_silenced():  # [Note: Kineto's start and stop lines]
            self._prof.__enter__()

    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.device.type == "cuda":
            if self._before_optimizer is None:
                d = self.device
                self._before_optimizer = (d.peak_allocated(), d.allocated(), d.peak_reserved())
                d.reset_peak()
        elif self._block is None:
            self._block = record_function(OPTIMIZER_BLOCK)
            self._block.__enter__()

    def end(self) -> PeakMemory:
        """After the step: this rank's :class:`PeakMemory` (``optimizer_temp_bytes`` 0 where no optimizer ran)."""
        self.measuring = False
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        d = self.device
        d.synchronize()
        if d.type == "cuda":
            peak, reserved = d.peak_allocated(), d.peak_reserved()
            if self._before_optimizer is None:
                return PeakMemory(peak, self._start_bytes, 0, reserved)
            before_peak, before, before_reserved = self._before_optimizer
            return PeakMemory(max(peak, before_peak), self._start_bytes, peak - before, max(reserved, before_reserved))
        if self._block is not None:
            self._block.__exit__(None, None, None)
            self._block = None
        with stderr_silenced():
            self._prof.__exit__(None, None, None)
        prof, self._prof = self._prof, None
        return PeakMemory(self._start_bytes + step_peak(profiler_allocations(prof)), self._start_bytes,
                          step_peak(profiler_allocations(prof, within=OPTIMIZER_BLOCK)))

    def abandon(self) -> None:
        """A step that raised: the meter stopped if it runs (on CPU its profiler would run on), its figure
        dropped."""
        if self.measuring:
            with contextlib.suppress(Exception):  # the step's own error is the one the caller reports
                self.end()
