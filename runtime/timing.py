"""Timing a step on every rank: the project's one timer of a callable, the step counter, a failed step.

The recorder, the measured rounds and the in-loop tuner all time through :func:`timed_ms` (or take the same barrier,
:func:`synchronize` and ``perf_counter`` at their ends), so a step's ms mean the same wherever they were taken.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from runtime.workload import Workload


def synchronize(device_type: str) -> None:
    """Wait for the device (no-op on CPU, where compute is synchronous)."""
    if device_type == "cuda":
        torch.cuda.synchronize()


def device_type_of(workload: Workload) -> str:
    """``"cpu"`` or ``"cuda"``: where the model's parameters live."""
    return next(workload.model.parameters()).device.type


def timed_ms(run: Callable[[], object], device_type: str) -> float:
    """This rank's wall time of ``run()``, ms: every rank starts together (a barrier), and the device is
    synchronized on both ends, so on GPU the kernels ``run`` queued are in the time. The project's one timer of a
    callable; the recorder's two-part step and the in-loop tuner's step around the user's code take the same
    barrier, synchronize and ``perf_counter`` at their ends."""
    dist.barrier()
    synchronize(device_type)
    t0 = time.perf_counter()
    run()
    synchronize(device_type)
    return (time.perf_counter() - t0) * 1e3


class StepFailed(Exception):
    """A training step raised while measuring plan ``index`` (``__cause__`` is the exception)."""

    def __init__(self, index: int, error: BaseException):
        super().__init__(f"plan {index}: {type(error).__name__}: {error}")
        self.index = index
        self.error = error


class StepCounter:
    """The global step index: each training step draws ``make_batch(index)``; every rank counts alike."""

    def __init__(self) -> None:
        self.index = 0

    def next(self) -> int:
        """The index of the step about to run."""
        self.index += 1
        return self.index - 1
