"""A step on every rank: what kind of step it is and which plan it runs (``RoundStep``), which device it runs on,
the step counter, a failed step. The step runner is :mod:`runtime.recording.steps`; timing is
:class:`runtime.ranks.device.Device`'s, the one place that reads the clock and waits for the device."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from planner.errors import one_line
from planner.failed_steps import StepFailure
from runtime.out_of_memory import is_out_of_memory
from runtime.workload import Workload

# What a step of the round is: WARMUP untimed, PEAK untimed with this rank's peak memory measured, TIMED timed.
WARMUP, PEAK, TIMED = "warmup", "peak", "timed"
# The recording's steps (FSDP2's default, plan 0), run by the same step runner (runtime.recording.steps.StepSide):
# RECORD_WARMUP untimed, RECORD timed, RECORD_PEAK measuring peak memory, RECORD_TRACE untimed under a Kineto trace
# that reads the collectives on the transfer's own clock (runtime.recording.collective_trace).
RECORD_WARMUP, RECORD, RECORD_PEAK, RECORD_TRACE = "record-warmup", "record", "record-peak", "record-trace"
# The in-loop watch's steps (runtime.in_loop.watching): timed on this rank alone, no barrier.
WATCHED = "watched"


@dataclass(frozen=True)
class RoundStep:
    """One training step a round, a recording or a watch asks for: its kind and its plan (an index into the step
    runner's plans; in a round ``runtime.measuring.round.MeasuredRound.plans``, 0 the baseline: FSDP2's default,
    or the plan the model arrived with)."""

    kind: str
    plan: int


def step_failure(plan: int | None, error: BaseException) -> StepFailure:
    """The failure of a step of ``plan`` that raised ``error``: a victim when a collective failed because of a peer
    (``torch.distributed.DistError``, gloo's timeout or closed connection, an aborted NCCL communicator)."""
    words = str(error)
    victim = (isinstance(error, getattr(dist, "DistError", ())) or "Timed out" in words or "Connection" in words
              or "abort" in words.lower())
    return StepFailure(plan, one_line(error), victim, is_out_of_memory(error))


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
