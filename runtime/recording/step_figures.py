"""The figures a profile takes from FSDP2's default steps, for the tune job's recorder and the in-loop tuner's alike:
a recorder of the one step runner (``runtime.recording.steps.StepSide``, which begins and ends it around each step).

- step ms: a timed step's, as the step runner times it (on the device's clock, its block started together:
  [Note: What a step costs the device] in ``runtime.recording.steps``);
- optimizer ms: from the first ``optimizer.step()`` of a timed step to the last one's end, on the device's clock
  (marks recorded by global optimizer hooks, ``register_optimizer_step_pre_hook``; no synchronization);
- every mark is read once, when the figures are taken (:meth:`StepFigures.measurements`);
- microbatches: the root's forwards in each step (gradient accumulation);
- peak bytes and the optimizer step's temporaries: a peak step's, through the one peak meter
  (:class:`runtime.recording.peak_memory.PeakMeter`); such a step is not timed;
- optimizer state bytes: the optimizers the steps ran (each seen by its hook), at the end.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from planner.artifacts.rank_measurements import StepMeasurements
from planner.errors import PlannerError, one_line
from planner.traces.in_step_collectives import CollectiveCall
from runtime.ranks.device import device_of
from runtime.recording.collective_trace import CollectiveTrace
from runtime.recording.peak_memory import PeakMeter

logger = logging.getLogger(__name__)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of ``optimizer``'s state tensors on this rank (DTensors: their local shard)."""
    return sum(
        (v.to_local() if hasattr(v, "to_local") else v).numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


class StepFigures:
    """Hooks on the model and the optimizers while FSDP2's default runs, and the step figures they read.

    Args:
        model: the root FSDP module.
        optimizers: the optimizers known already (a workload's); those the steps run are added as their hooks see
            them.
    """

    def __init__(self, model: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()):
        self.model = model
        self.device = next(model.parameters()).device.type
        self.optimizers: list[torch.optim.Optimizer] = list(optimizers)
        self.forwards = 0
        self.microbatches: list[int] = []
        self.step_spans: list[tuple[Any, Any]] = []  # the timed steps' (start, end) marks, read in measurements()
        self.optimizer_spans: list[tuple[Any, Any]] = []
        self.peaks: list[int] = []
        self.optimizer_temp: list[int] = []
        self._opt_start: Any = None  # marks on the device's clock (runtime.ranks.device.Device.mark)
        self._opt_end: Any = None
        self.meter = PeakMeter(model, self.optimizers)
        self.trace = CollectiveTrace(self.device)  # started by the first traced step, if any
        self.collective_calls: list[CollectiveCall] | None = None  # the traced steps' collectives, once read
        self._handles = [
            model.register_forward_pre_hook(self._root_forward, with_kwargs=True),
            register_optimizer_step_pre_hook(self._optimizer_pre),
            register_optimizer_step_post_hook(self._optimizer_post),
        ]

    def _root_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.forwards += 1

    def _optimizer_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not any(o is optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)
        if self._opt_start is None:
            self._opt_start = device_of(self.device).mark()

    def _optimizer_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._opt_end = device_of(self.device).mark()

    def begin_step(self, peak: bool, trace: bool = False) -> None:
        """Before a step (every rank); ``peak``: measure its peak memory, ``trace``: run it under the collectives'
        trace (either step is then not timed)."""
        self.forwards = 0
        self._opt_start = self._opt_end = None
        if peak:
            self.meter.begin()
        if trace:
            self.trace.begin_step()

    def end_step(self, span: tuple[Any, Any] | None) -> None:
        """After a step: ``span`` the start and end marks of a timed step, ``None`` for an untimed one."""
        self.microbatches.append(self.forwards)
        self.trace.end_step()
        if span is not None:
            self.step_spans.append(span)
            if self._opt_start is not None and self._opt_end is not None:
                self.optimizer_spans.append((self._opt_start, self._opt_end))
        if self.meter.measuring:
            peak = self.meter.end()
            self.peaks.append(peak.peak_bytes)
            self.optimizer_temp.append(peak.optimizer_temp_bytes)

    def abandon(self) -> None:
        """A step that raised: a peak step's meter stopped, its figure dropped (the step's microbatches and times
        are not kept either); a traced step's trace stopped and dropped."""
        self.meter.abandon()
        self.trace.abandon()

    def read_collectives(self) -> list[CollectiveCall] | None:
        """The traced steps' collectives on this rank (the trace stopped and read, once); ``None`` where no step was
        traced, or where the trace could not be read (no FSDP2 step in it, e.g. no kernels without CUPTI: one
        warning line, and the collectives' isolated figures stand)."""
        if self.trace.running:
            try:
                self.collective_calls = self.trace.calls()
            except PlannerError as e:
                logger.warning(f"the collectives' trace could not be read ({one_line(e)}); their isolated times "
                               "stand")
        return self.collective_calls

    def remove(self) -> None:
        """Remove every hook (the recording is over); a trace still running is stopped and dropped."""
        if self.trace.running:
            self.trace.abandon()
        for h in self._handles:
            h.remove()
        self._handles = []

    def measurements(self, **more: Any) -> StepMeasurements:
        """This rank's step figures: the medians of the timed steps' ms and optimizer ms, every peak step's peak,
        the optimizer step's largest temporaries, the optimizers' state; ``more``: the other
        :class:`~planner.artifacts.rank_measurements.StepMeasurements` fields (the async ratio, page faults, ...).

        Every mark is read here, once: one wait on the last (:meth:`runtime.ranks.device.Device.spans_ms`).

        Raises:
            PlannerError: no timed step or no peak step was recorded.
        """
        if not self.step_spans or not self.peaks:
            raise PlannerError("the recorder has no timed step or no peak-memory step")
        ms = device_of(self.device).spans_ms(self.optimizer_spans + self.step_spans)  # the last step's end last
        optimizer_ms, step_ms = ms[:len(self.optimizer_spans)], ms[len(self.optimizer_spans):]
        return StepMeasurements(step_ms=statistics.median(step_ms),
                                optimizer_ms=statistics.median(optimizer_ms) if optimizer_ms else 0.0,
                                peak_bytes=tuple(self.peaks), optimizer_temp_bytes=max(self.optimizer_temp, default=0),
                                optimizer_state_bytes=sum(optimizer_state_bytes(o) for o in self.optimizers), **more)
