"""Steps on the device's clock ([Note: What a step costs the device] in runtime.recording.steps): each kind of step
on a fake GPU whose events complete only when the test says, with every direct clock read, device synchronization,
barrier and ``.item()`` failing the test."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from planner.statistics.watch import Watch, WatchStep
from runtime.current import fsdp2_default
from runtime.in_loop import watching
from runtime.in_loop.watching import WatchedSteps
from runtime.ranks.device import Device
from runtime.recording import step_figures, steps
from runtime.recording.step_figures import StepFigures
from runtime.recording.steps import WorkloadSteps
from runtime.reference_workloads import mlp
from runtime.timing import PEAK, RECORD, RECORD_WARMUP, TIMED, WARMUP, RoundStep

STEP_MS = 10.0  # the fake device's time for one step


@dataclass
class FakeEvent:
    """A CUDA event on the fake device: the device's time when the stream reached it, and whether it has."""

    at: float
    complete: bool = False


class FakeGPU(Device):
    """A GPU whose clock the test moves (:meth:`run`), whose events complete only when the host waits for them or
    the test says (:meth:`finish`), and which counts what it is asked: ``calls["event"]``, ``"synchronize"``,
    ``"barrier"``, ``"wait"``, ``"query"``. Its host clock fails the test: a step is timed on the device's clock."""

    type = "cuda"

    def __init__(self) -> None:
        self.now = 0.0
        self.idle = True  # nothing queued: an event recorded now completes at once
        self.calls: Counter[str] = Counter()
        self.events: list[FakeEvent] = []
        self.groups: list[object] = []

    def run(self, ms: float) -> None:
        """The device is given ``ms`` of work (a step's kernels), finished only at :meth:`finish` or a wait."""
        self.now += ms
        self.idle = False

    def finish(self) -> None:
        """The device catches up with everything queued (the test's, not the host's, doing)."""
        for e in self.events:
            e.complete = True
        self.idle = True

    def clock(self) -> float:
        raise AssertionError("a step read the host clock")

    def synchronize(self) -> None:
        self.calls["synchronize"] += 1
        self.finish()

    def barrier(self, group: object = None) -> None:
        self.calls["barrier"] += 1
        self.groups.append(group)

    def mark(self) -> FakeEvent:
        self.calls["event"] += 1
        self.events.append(FakeEvent(self.now, complete=self.idle))
        return self.events[-1]

    def done(self, mark: FakeEvent) -> bool:
        self.calls["query"] += 1
        return mark.complete

    def wait(self, mark: FakeEvent) -> None:
        self.calls["wait"] += 1
        for e in self.events[:self.events.index(mark) + 1]:
            e.complete = True
        self.idle = mark is self.events[-1]

    def _interval_ms(self, start: FakeEvent, end: FakeEvent) -> float:
        if not (start.complete and end.complete):
            raise RuntimeError("CUDA error: device not ready")  # cudaEventElapsedTime on an incomplete event
        return end.at - start.at


def _forbidden(what: str):
    def call(*args, **kwargs):
        raise AssertionError(f"{what} called directly")
    return call


@pytest.fixture(scope="module")
def workload(mesh):
    return mlp(mesh, dim=16, layers=2)


@pytest.fixture
def gpu(workload, monkeypatch):
    """The fake GPU behind the step runner and the recorder's figures, the workload's step a fake one that takes
    :data:`STEP_MS` on it (and runs the optimizer's hooks), and the direct calls failing the test."""
    device = FakeGPU()
    monkeypatch.setattr(steps, "device_of", lambda _type: device)
    monkeypatch.setattr(step_figures, "device_of", lambda _type: device)

    def fake_step(w, index):
        device.run(STEP_MS - 2.0)
        w.optimizer.step()  # no gradient: the optimizer hooks fire, nothing moves
        device.run(2.0)

    monkeypatch.setattr(steps, "train_step", fake_step)
    monkeypatch.setattr(torch.cuda, "synchronize", _forbidden("torch.cuda.synchronize"))
    monkeypatch.setattr(torch.Tensor, "item", _forbidden("Tensor.item"))
    monkeypatch.setattr(dist, "barrier", _forbidden("dist.barrier"))
    monkeypatch.setattr(time, "perf_counter", _forbidden("time.perf_counter"))
    return device


def test_a_raced_block_aligns_once_before_it_and_waits_once_after_it(workload, gpu):
    group = object()
    runner = WorkloadSteps(workload, [fsdp2_default(workload.model)] * 2, group, applied=0)
    block = [RoundStep(TIMED, i % 2) for i in range(6)]
    times, failure = runner.run(block)
    assert failure is None and times == [STEP_MS] * 6
    # before the first step: synchronize, barrier on the control group, synchronize; after the last: one wait
    assert gpu.calls == {"event": 12, "synchronize": 2, "barrier": 1, "wait": 1} and gpu.groups == [group]
    gpu.calls.clear()
    times, _ = runner.run(block)  # the next block aligns again: the gather between them ran on the hosts
    assert gpu.calls == {"event": 12, "synchronize": 2, "barrier": 1, "wait": 1}


def test_a_timed_step_after_an_untimed_one_aligns_again(workload, gpu):
    runner = WorkloadSteps(workload, [fsdp2_default(workload.model)], object(), applied=0)
    runner.run([RoundStep(TIMED, 0), RoundStep(WARMUP, 0), RoundStep(TIMED, 0)])
    assert gpu.calls["barrier"] == 2 and gpu.calls["wait"] == 1


def test_a_step_that_raised_reads_no_event(workload, gpu, monkeypatch):
    runner = WorkloadSteps(workload, [fsdp2_default(workload.model)], object(), applied=0)
    calls = iter([None, RuntimeError("boom")])

    def step(w, index):
        if (e := next(calls)) is not None:
            raise e
        gpu.run(STEP_MS)

    monkeypatch.setattr(steps, "train_step", step)
    times, failure = runner.run([RoundStep(TIMED, 0)] * 2)
    assert times == [] and failure.error == "RuntimeError: boom"
    assert gpu.calls["wait"] == 0 and gpu.calls["query"] == 0 and runner.side.spans == []


def test_the_recorders_steps_are_read_once_when_its_figures_are_taken(workload, gpu):
    runner = WorkloadSteps(workload, [fsdp2_default(workload.model)], object(), applied=0)
    figures = runner.side.recorder = StepFigures(workload.model, [workload.optimizer])
    try:
        runner.run_all([RoundStep(RECORD_WARMUP, 0)] + [RoundStep(RECORD, 0)] * 4)
        assert gpu.calls["wait"] == 0 and gpu.calls["synchronize"] == 2  # the stretch's alignment, nothing after
        figures.peaks.append(1)  # a peak step's figure (the peak meter is tested apart)
        measured = figures.measurements()
    finally:
        figures.remove()
        runner.side.recorder = None
    assert measured.step_ms == STEP_MS and measured.optimizer_ms == 0.0
    assert gpu.calls["wait"] == 1 and gpu.calls["barrier"] == 1


def test_a_peak_step_is_untimed(workload, gpu):
    runner = WorkloadSteps(workload, [fsdp2_default(workload.model)], object(), applied=0)
    peaks: list[list[int]] = [[]]
    times, _ = runner.run([RoundStep(PEAK, 0)], peaks)
    assert times == [] and len(peaks[0]) == 1 and gpu.calls["event"] == 0 and gpu.calls["barrier"] == 0


def _watched(workload, monkeypatch, every: int = 16) -> WatchedSteps:
    monkeypatch.setattr(watching, "broadcast_from_rank0", lambda payload, group: payload)
    runner = WorkloadSteps(workload, [fsdp2_default(workload.model)] * 2, object(), applied=0)
    return WatchedSteps(runner.side, Watch(every, seed=3), rank0=True)


def _one_step(watch: WatchedSteps, gpu: FakeGPU, ms: float = STEP_MS, keep_up: bool = False):
    """One watched step of ``ms`` on the device; ``keep_up``: the device has finished it when the host ends it."""
    watch.before()
    gpu.run(ms)
    if keep_up:
        gpu.finish()
    return watch.after()


def test_a_watched_step_never_waits_for_the_device(workload, gpu, monkeypatch):
    watch = _watched(workload, monkeypatch)
    for _ in range(15):
        assert _one_step(watch, gpu) is None
    assert gpu.calls == {"event": 30}  # two events a step: no synchronize, no barrier, no wait, no query


def test_a_watch_block_is_read_once_when_the_device_has_finished_it(workload, gpu, monkeypatch):
    watch = _watched(workload, monkeypatch)
    for _ in range(16):  # the first block ends; the device is still behind (its events not complete)
        state = _one_step(watch, gpu)
    assert state.blocks == 0 and gpu.calls == {"event": 32, "query": 1}  # looked at once, not waited for
    gpu.finish()
    gpu.calls.clear()
    for _ in range(16):  # the second block ends: the first is read now, the second (still running) later
        state = _one_step(watch, gpu)
    assert state.blocks == 1 and state.steps == 16 and state.ratio == pytest.approx(1.0)
    assert gpu.calls == {"event": 32, "query": 2}  # the first block's last event, then the second's
    gpu.finish()
    gpu.calls.clear()
    for _ in range(16):
        state = _one_step(watch, gpu)
    assert state.blocks == 2 and len(watch.side.spans) == 16 and gpu.calls == {"event": 32, "query": 2}
    gpu.finish()
    for _ in range(16):
        state = _one_step(watch, gpu)
    assert state.blocks == 3 and len(watch.side.spans) == 16 and gpu.calls["wait"] == 0  # the fourth still running


def test_the_watch_reads_each_steps_own_span(workload, gpu, monkeypatch):
    watch = _watched(workload, monkeypatch)
    block = watch.watch.next_block()
    watch.watch = Watch(16, seed=3)  # the same positions again for the steps below
    for step in block:  # FSDP2's default twice as slow as the plan; the device keeps up
        _one_step(watch, gpu, 2 * STEP_MS if step.runs_default else STEP_MS, keep_up=True)
    assert watch.state.blocks == 1 and watch.state.ratio == pytest.approx(0.5)
    assert WatchStep.DEFAULT in block
