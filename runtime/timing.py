"""A step on every rank: which device it runs on, the step counter, a failed step. Timing is
:class:`runtime.ranks.device.Device`'s (``timed_ms``), the one place that reads the clock and waits for the device."""

from __future__ import annotations

from runtime.workload import Workload


def device_type_of(workload: Workload) -> str:
    """``"cpu"`` or ``"cuda"``: where the model's parameters live."""
    return next(workload.model.parameters()).device.type


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
