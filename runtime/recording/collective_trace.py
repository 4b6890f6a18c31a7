"""A Kineto trace of a few of FSDP2's default steps, for each all-gather's and reduce-scatter's time on the transfer's
own clock ([Note: Collectives on NCCL's clock] in :mod:`planner.traces.in_step_collectives`).

The step runner begins and ends each traced step (a ``RECORD_TRACE`` step, ``runtime.recording.steps``); the
profiler runs from the first traced step's start to the last one's end, each step inside a ``ProfilerStep#N``
range (as ``torch.profiler``'s own schedule labels its steps), with the CPU activity (FSDP2's labels) and, on a
GPU, the CUDA activity (CUPTI's kernel records, NCCL's kernels on NCCL's stream among them). The trace goes to a
temporary file, is read by :mod:`planner.traces` and removed.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

from torch.profiler import ProfilerActivity, profile, record_function

from planner.artifacts.names import CollectiveTiming
from planner.traces.fsdp_steps import rank_steps
from planner.traces.in_step_collectives import CollectiveCall, rank_calls
from planner.traces.kineto import read_trace
from runtime.ranks.torch_private import profiler_running
from runtime.recording.peak_memory import stderr_silenced

logger = logging.getLogger(__name__)

# Traced steps of FSDP2's default: each module's collectives twice (the median of two calls per rank).
TRACED_STEPS = 2
AUTO = CollectiveTiming.AUTO


def traces_collectives(setting: str, device_type: str) -> bool:
    """Whether the recorder takes the collectives from traced steps (``[measure] collectives``): ``"in-step"``
    always, ``"isolated"`` never, ``"auto"`` on a GPU only (the CPU simulator's overlap and communication scale are
    solved against the isolated figures)."""
    return setting == CollectiveTiming.IN_STEP or (setting == CollectiveTiming.AUTO and device_type == "cuda")


class CollectiveTrace:
    """The profiler over this rank's traced steps (:meth:`begin_step`, :meth:`end_step`), then its collectives
    (:meth:`calls`).

    Args:
        device_type: ``"cpu"`` or ``"cuda"`` (the CUDA activity is traced on a GPU).
    """

    def __init__(self, device_type: str):
        self.device_type = device_type
        self.steps = 0
        self.refused: str | None = None  # why the profiler did not start (another one runs): nothing traced
        self._prof: Any = None
        self._range: Any = None

    @property
    def running(self) -> bool:
        """Whether the profiler runs (between the first traced step's start and :meth:`calls`)."""
        return self._prof is not None

    def begin_step(self) -> None:
        """Before a traced step: the profiler started (the first), the step's ``ProfilerStep#N`` range entered."""
        if self.refused is not None:
            return
        if self._prof is None:
            if profiler_running():  # the user's own profiler: a second would end its session; the isolated stand
                self.refused = "another torch.profiler session is running"
                logger.warning(f"the collectives' trace did not start ({self.refused}); their isolated times stand")
                return
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device_type == "cuda" else [])
            self._prof = profile(activities=activities, record_shapes=True)
            with stderr_silenced():  # [Note: Kineto's start and stop lines] in runtime.recording.peak_memory
                self._prof.__enter__()
        self._range = record_function(f"ProfilerStep#{self.steps}")
        self._range.__enter__()

    def end_step(self) -> None:
        """After a traced step: its range left."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
            self.steps += 1

    def abandon(self) -> None:
        """A traced step raised: the range left, the profiler stopped, nothing kept."""
        self.end_step()
        if self._prof is not None:
            with stderr_silenced():
                self._prof.__exit__(None, None, None)
            self._prof = None
        self.steps = 0

    def calls(self) -> list[CollectiveCall]:
        """The profiler stopped and its trace read: this rank's collectives in the traced steps (call it only while
        :attr:`running`).

        Raises:
            TraceFormatError: the trace holds no whole FSDP2 step (``planner.traces.fsdp_steps.rank_steps``).
        """
        prof, self._prof = self._prof, None
        with stderr_silenced():
            prof.__exit__(None, None, None)
        fd, path = tempfile.mkstemp(prefix="prefetch-planner-collectives-", suffix=".json")
        os.close(fd)
        try:
            prof.export_chrome_trace(path)
            return rank_calls(rank_steps(read_trace(path)))
        finally:
            os.unlink(path)
