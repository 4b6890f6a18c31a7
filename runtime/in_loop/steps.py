"""What the in-loop tuner does around each of the user's steps: the plan switched, the recorder or the peak meter
begun and ended, the step timed, the microbatches counted. ``runtime.in_loop.autotuner.AutoTuner`` decides what
each step is (a :class:`~runtime.measuring.round.RoundStep`); :class:`StepSide` runs it, on every rank."""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from planner.artifacts.plan import Plan
from runtime.accumulation import set_microbatch_resharding
from runtime.apply import configure_plan
from runtime.in_loop.recorder import LoopRecorder, PeakMeter
from runtime.in_loop.round import RECORD, RECORD_PEAK, RECORD_WARMUP
from runtime.measuring.round import PEAK, TIMED, RoundStep
from runtime.ranks.device import device_of
from runtime.workload import fsdp_modules

RECORDING = (RECORD_WARMUP, RECORD, RECORD_PEAK)


class StepSide:
    """Runs each of the tuner's steps around the user's code (every rank, the same steps).

    Attributes:
        plans: the plans a step may run (0: FSDP2's default); the one applied now is ``plans[applied]``.
        recorder: the recorder while the profile is recorded; ``None`` after.
        meter: the peak meter of the race's peak steps, once the recording is over.
        times: the ms of the timed steps since :meth:`take_times`.
        microbatches: the user's root forwards per step, as recorded.
    """

    def __init__(self, model: nn.Module, device: str, group: Any, default: Plan):
        self.model, self.device, self.group = model, device, group
        self.plans: list[Plan] = [default]
        self.applied = 0
        self.recorder: LoopRecorder | None = None
        self.meter: PeakMeter | None = None
        self.times: list[float] = []
        self.microbatches = 1
        self.optimizers: list[Any] = []
        self._microbatch = 0  # this step's root forwards so far
        self._hooks: list[Any] = []

    def hook_microbatches(self) -> None:
        """Count the root's forwards in each step and set ``reshard_after_backward`` for each microbatch."""
        self._hooks.append(self.model.register_forward_pre_hook(self._before_microbatch))

    def watch_optimizers(self) -> None:
        """Note each optimizer the user's steps run (the peak meter counts their state), then meter the peaks."""
        self._hooks.append(register_optimizer_step_pre_hook(self._seen_optimizer))
        self.meter = PeakMeter(self.model, self.optimizers)

    def race(self, plans: list[Plan]) -> None:
        """From now on a step may run any of ``plans`` (0: FSDP2's default, applied now)."""
        self.plans, self.applied = plans, 0

    def recorded(self, microbatches: int) -> None:
        """The recording is over: its recorder's hooks go, the peak meter counts its optimizers."""
        if self.recorder is not None:
            self.meter = PeakMeter(self.model, self.recorder.optimizers)
            self.recorder.remove()
            self.recorder = None
        self.microbatches = microbatches

    def take_times(self) -> list[float]:
        """The timed steps' ms so far, and a fresh list for the next block."""
        times, self.times = self.times, []
        return times

    def remove(self) -> None:
        """Take every hook out (the tuner is done)."""
        if self.recorder is not None:
            self.recorder.remove()
            self.recorder = None
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def before(self, order: RoundStep) -> float | None:
        """Before the user's step: its plan applied, the recorder or meter begun; for a timed step, every rank
        started together (a barrier, the device synchronized) and the clock read."""
        self._microbatch = 0
        if order.plan != self.applied:
            configure_plan(self.model, self.plans[order.plan], check=False)
            self.applied = order.plan
        if order.kind in RECORDING:
            self.recorder.begin_step(peak=order.kind == RECORD_PEAK)
        elif order.kind == PEAK:
            self.meter.begin()
        if order.kind not in (RECORD, TIMED):
            return None
        return device_of(self.device).start(self.group)  # the control group's ([Note: Which group a barrier uses])

    def after(self, order: RoundStep, t0: float | None, peaks: list[list[int]]) -> None:
        """After the user's step: its ms (timed steps), a plan's parameters resharded after the last microbatch,
        the recorder or meter ended (a peak step's peak appended to ``peaks[order.plan]``)."""
        ms = None if t0 is None else device_of(self.device).elapsed_ms(t0)
        if self.microbatches > 1:  # a plan that kept parameters unsharded after a microbatch
            for _, m in fsdp_modules(self.model):
                m.reshard()
        if order.kind in RECORDING:
            self.recorder.end_step(ms)
        elif order.kind == PEAK:
            peaks[order.plan].append(self.meter.end()[0])
        elif order.kind == TIMED:
            self.times.append(ms)

    def abandon(self) -> None:
        """A step that raised: the peak meter it began is stopped (on CPU its profiler would run on), its figure
        dropped."""
        if self.meter is not None and self.meter.measuring:
            with contextlib.suppress(Exception):  # the step's own error is the one the caller reports
                self.meter.end()

    def _before_microbatch(self, module: nn.Module, args: Any) -> None:
        """Root pre-forward: a plan's ``reshard_after_backward`` for every microbatch but the step's last
        (``runtime.accumulation``; the recorded microbatch count tells which is last)."""
        n = self.microbatches
        if n > 1:
            last = self._microbatch >= n - 1
            set_microbatch_resharding(self.model, last)
        self._microbatch += 1

    def _seen_optimizer(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not any(o is optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)
