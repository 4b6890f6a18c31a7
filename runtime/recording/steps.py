"""The one step runner: what happens around each training step, on every rank, for the tune job's ranks, its recorder
and the in-loop tuner alike.

A step is a :class:`~runtime.timing.RoundStep` (its kind and its plan). :class:`StepSide` runs it around
the step itself: the plan switched, the recorder or the peak meter begun and ended, the step timed on the device's
clock ([Note: Steps on the device's clock] in ``runtime.ranks.device``), the microbatches counted. What the step
itself is differs, and only that:

- the in-loop tuner (``runtime.in_loop.autotuner.AutoTuner``) calls :meth:`StepSide.before` and
  :meth:`StepSide.after` around the user's own code in ``tuner.step()``;
- the tune job, its recorder's steps of FSDP2's default, its confirmation and calibration launches, ``confirm`` and
  the benches feed it the workload's own training step (``runtime.workload.train_step``) through
  :class:`WorkloadSteps`.

[Note: What a step costs the device]
Per kind of step, what the runner asks of the device beyond the step itself (``tests/runtime/recording/
test_device_clock.py`` holds each line on a fake device whose direct clock, synchronize, barrier and ``.item()``
fail the test):

- ``WATCHED`` (the watch, for the rest of the job): two events recorded on the current stream; no synchronization,
  no barrier, no wait. The watch reads a block's events once, when ``Event.query()`` says its last one is
  complete (``runtime.in_loop.watching``).
- ``TIMED`` and ``RECORD`` (a race's or a confirmation's block, the recorder's timed steps of FSDP2's default): two
  events per step and nothing else inside the block. The block, not the step, starts and ends together: before its
  first step the device is synchronized, the ranks meet at a barrier on the control group and the device is
  synchronized again (:meth:`runtime.ranks.device.Device.align`: every rank starts from an idle device, at the same
  moment), and after its last step the host waits once, on that step's end event, to read the block's events
  (:meth:`StepSide.take_times`). An untimed step between two timed ones makes the next one align again.
- ``PEAK`` and ``RECORD_PEAK`` (a plan's warm-up, the recording's): untimed; the peak meter synchronizes at the
  step's two ends to read the allocator's peak (``runtime.recording.peak_memory``).
- ``WARMUP`` and ``RECORD_WARMUP``: nothing.
- ``RECORD_TRACE`` (a few of the recording's, where the collectives are read in-step): untimed, under a Kineto trace
  (``runtime.recording.collective_trace``), which is read once, after the last.

The recorder's optimizer ms are events as well, recorded by the optimizer hooks (``runtime.recording.step_figures``)
and read with the recording's step marks, once, when its figures are taken.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from planner.artifacts.plan import Plan
from planner.failed_steps import StepFailure
from runtime.accumulation import set_microbatch_resharding
from runtime.apply import configure_plan
from runtime.ranks.device import device_of
from runtime.recording.peak_memory import PeakMeter
from runtime.timing import (
    PEAK,
    RECORD,
    RECORD_PEAK,
    RECORD_TRACE,
    RECORD_WARMUP,
    TIMED,
    WATCHED,
    RoundStep,
    StepCounter,
    StepFailed,
    device_type_of,
    step_failure,
)
from runtime.workload import Workload, fsdp_modules, train_step

RECORDING = (RECORD_WARMUP, RECORD, RECORD_PEAK, RECORD_TRACE)


class StepRecorder(Protocol):
    """What the step runner asks of a recorder (``runtime.recording.step_figures.StepFigures``, and the recorder
    built on it, ``runtime.recording.recorder.Recorder``)."""

    optimizers: list[Any]

    def begin_step(self, peak: bool, trace: bool = False) -> None:
        """Before a step; ``peak``: measure its peak memory; ``trace``: run it under the collectives' trace."""

    def end_step(self, span: tuple[Any, Any] | None) -> None:
        """After a step: its start and end marks on the device's clock if it was timed (read later, with the
        recording's other marks: [Note: Steps on the device's clock] in ``runtime.ranks.device``)."""

    def abandon(self) -> None:
        """A step that raised: a peak step's meter stopped, its figure dropped."""

    def remove(self) -> None:
        """Its hooks out."""


class StepSide:
    """Runs each of the tuner's steps around the user's code (every rank, the same steps).

    Attributes:
        plans: the plans a step may run (0: FSDP2's default); the one applied now is ``plans[applied]``.
        recorder: the recorder while the profile is recorded; ``None`` after.
        meter: the peak meter of the race's peak steps, once the recording is over.
        spans: the start and end marks of the timed and watched steps not read yet (:meth:`take_times`,
            :meth:`take_ready`).
        microbatches: the user's root forwards per step, as recorded.
    """

    def __init__(self, model: nn.Module, device: str, group: Any, default: Plan):
        self.model, self.device, self.group = model, device, group
        self.plans: list[Plan] = [default]
        self.applied: int | None = 0
        self.recorder: StepRecorder | None = None
        self.meter: PeakMeter | None = None
        self.spans: list[tuple[Any, Any]] = []
        self.aligned = False  # the ranks met and the device idled before this stretch of together-timed steps
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

    def race(self, plans: list[Plan], applied: int | None = 0) -> None:
        """From now on a step may run any of ``plans``; ``applied``: the index of the one applied now (``None``:
        unknown, the first step applies its plan); the marks of the steps before are dropped."""
        self.plans, self.applied, self.spans, self.aligned = list(plans), applied, [], False

    def recorded(self, microbatches: int) -> None:
        """The recording is over: its recorder's hooks go, the peak meter counts its optimizers."""
        if self.recorder is not None:
            self.meter = PeakMeter(self.model, self.recorder.optimizers)
            self.recorder.remove()
            self.recorder = None
        self.microbatches = microbatches

    def apply(self, index: int) -> None:
        """Apply ``plans[index]`` now, between two steps."""
        configure_plan(self.model, self.plans[index], check=False)
        self.applied = index

    def take_times(self) -> list[float]:
        """The timed and watched steps' ms since the last read, in step order, and a fresh start for the next block:
        the host waits once, on the last step's end event; the next together-timed step aligns the ranks again
        ([Note: What a step costs the device])."""
        spans, self.spans, self.aligned = self.spans, [], False
        return device_of(self.device).spans_ms(spans)

    def take_ready(self, n: int) -> list[float] | None:
        """The first ``n`` unread steps' ms if the device has finished the ``n``-th (``Event.query()``, no wait), and
        those steps' marks dropped; ``None`` while it has not (nothing dropped).

        Raises:
            ValueError: fewer than ``n`` steps are unread.
        """
        if n > len(self.spans):
            raise ValueError(f"{n} steps asked for, {len(self.spans)} unread")
        device = device_of(self.device)
        if n and not device.done(self.spans[n - 1][1]):
            return None
        spans, self.spans = self.spans[:n], self.spans[n:]
        return device.spans_ms(spans, wait=False)

    def remove(self) -> None:
        """Take every hook out (the tuner is done)."""
        if self.recorder is not None:
            self.recorder.remove()
            self.recorder = None
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def before(self, order: RoundStep) -> Any:
        """Before the user's step: its plan applied, the recorder or meter begun; for a timed or watched step its
        start mark (the first together-timed step of a stretch aligns the ranks first: [Note: What a step costs the
        device]); ``None`` for an untimed step."""
        self._microbatch = 0
        if order.plan != self.applied:
            self.apply(order.plan)
        if order.kind in RECORDING:
            self.recorder.begin_step(peak=order.kind == RECORD_PEAK, trace=order.kind == RECORD_TRACE)
        elif order.kind == PEAK:
            self.meter.begin()
        device = device_of(self.device)
        if order.kind == WATCHED:  # this rank alone: runtime.in_loop.watching says why
            return device.mark()
        if order.kind not in (RECORD, TIMED):
            self.aligned = False
            return None
        if not self.aligned:
            device.align(self.group)  # the control group's ([Note: Which group a barrier uses])
            self.aligned = True
        return device.mark()

    def after(self, order: RoundStep, start: Any, peaks: list[list[int]]) -> None:
        """After the user's step: its end mark (timed and watched steps; read later, :meth:`take_times`), a plan's
        parameters resharded after the last microbatch, the recorder or meter ended (a peak step's peak appended to
        ``peaks[order.plan]``)."""
        span = None if start is None else (start, device_of(self.device).mark())
        if self.microbatches > 1:  # a plan that kept parameters unsharded after a microbatch
            for _, m in fsdp_modules(self.model):
                m.reshard()
        if order.kind in RECORDING:
            self.recorder.end_step(span)
        elif order.kind == PEAK:
            peaks[order.plan].append(self.meter.end().peak_bytes)
        elif order.kind in (TIMED, WATCHED):
            self.spans.append(span)

    def abandon(self) -> None:
        """A step that raised: the peak meter it began, the race's or the recorder's, is stopped (on CPU its
        profiler would run on), its figure dropped; the unread steps' marks are dropped (never waited on: a peer's
        failure may hold them behind a collective) and the next together-timed step aligns the ranks again."""
        self.spans, self.aligned = [], False
        if self.meter is not None:
            self.meter.abandon()
        if self.recorder is not None:
            self.recorder.abandon()

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


class WorkloadSteps:
    """The step runner fed by a workload's own training step (``runtime.workload.train_step``): the tune job's
    ranks, its confirmation and calibration launches, ``confirm`` and the benches.

    Args:
        workload: this rank's workload.
        plans: the plans a step may run (:class:`StepSide`'s; which one is applied now is not assumed).
        group: the group a timed step's barrier takes (the control group where there is one; ``None``: training's
            default group, [Note: Which group a barrier uses] in ``runtime.ranks.device``).
        counter: the global step index every rank counts alike (each step draws ``make_batch(index)``).
        applied: the index of the plan applied now; ``None``: unknown (the first step applies its plan).
        board: the failure board (``runtime.ranks.failures``): checked before each step of :meth:`run`, which
            stops at a failure a peer posted (the round's agreement comes next).
    """

    def __init__(self, workload: Workload, plans: Sequence[Plan], group: Any = None,
                 counter: StepCounter | None = None, applied: int | None = None, board: Any = None):
        self.workload = workload
        self.board = board
        self.side = StepSide(workload.model, device_type_of(workload), group, plans[0])
        self.side.race(list(plans), applied)
        self.side.meter = PeakMeter(workload.model, [workload.optimizer])
        self.counter = counter or StepCounter()

    def step(self, order: RoundStep, peaks: list[list[int]] | None = None) -> None:
        """One training step as ``order`` says (a peak step's peak appended to ``peaks[order.plan]``, a timed
        step's ms kept for :meth:`StepSide.take_times`); all ranks call this together. A peak step frees the
        gradients first (what ``train_step`` does first anyway), so that the meter starts without them
        (``runtime.recording.peak_memory.PeakMeter``)."""
        if order.kind in (PEAK, RECORD_PEAK):
            self.workload.optimizer.zero_grad(set_to_none=True)
        t0 = self.side.before(order)
        train_step(self.workload, self.counter.next())
        self.side.after(order, t0, peaks if peaks is not None else [[] for _ in self.side.plans])

    def run(self, steps: Sequence[RoundStep], peaks: list[list[int]] | None = None,
            on_step: Callable[[], None] | None = None) -> tuple[list[float], StepFailure | None]:
        """Run ``steps`` in order (:meth:`step`; ``on_step`` after each).

        Returns:
            This rank's timed steps' ms, in step order, and the step that raised (``None``: none did; the steps
            after it did not run). A failure a peer posted on the board stops the steps before the next one, with
            ``None``: the caller's next collective goes to the agreement instead. After a failure, this rank's or
            a peer's, no time is read (``[]``): a step's end event behind a collective a peer never joins would
            never complete, and the round drops those rounds anyway.
        """
        for order in steps:
            if self.board is not None and self.board.before_step():
                self.side.abandon()
                return [], None
            try:
                self.step(order, peaks)
            except Exception as e:  # noqa: BLE001 - reported at the round's next collective, where the cause is named
                self.side.abandon()
                return [], step_failure(order.plan, e)
            if on_step is not None:
                on_step()
        return self.side.take_times(), None

    def run_all(self, steps: Sequence[RoundStep]) -> list[float]:
        """Run ``steps`` in order (:meth:`step`); this rank's timed steps' ms, in step order.

        Raises:
            StepFailed: a step raised (names the index of its plan); the steps after it did not run.
        """
        for order in steps:
            try:
                self.step(order)
            except Exception as e:
                self.side.abandon()
                raise StepFailed(order.plan, e) from e
        return self.side.take_times()
