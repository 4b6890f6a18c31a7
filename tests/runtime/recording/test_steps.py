"""runtime.recording.steps: the one step runner. What each kind of step asks of the device (a counting fake), a
plan applied only where the steps switch, a meter stopped by a step that raised, and the peak meter starting without
the last step's gradients; the peak meter's GPU arithmetic on a fake allocator."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from runtime.current import fsdp2_default
from runtime.ranks.device import CountingDevice, Device
from runtime.recording import peak_memory, steps
from runtime.recording.peak_memory import PeakMemory, PeakMeter, bytes_alive
from runtime.recording.step_figures import StepFigures
from runtime.recording.steps import WorkloadSteps
from runtime.reference_workloads import mlp
from runtime.timing import PEAK, RECORD_PEAK, TIMED, WARMUP, WATCHED, RoundStep
from runtime.workload import train_step


@pytest.fixture(scope="module")
def workload(mesh):
    return mlp(mesh, dim=32, layers=2)


def test_each_kind_of_step_asks_the_device_for_what_it_needs(workload, monkeypatch):
    device = CountingDevice()
    device.barrier = lambda g=None: (device._count("barrier"), device.groups.append(g))  # no second rank here
    monkeypatch.setattr(steps, "device_of", lambda _type: device)
    group = object()
    runner = WorkloadSteps(workload, [fsdp2_default(workload.model)], group, applied=0)
    seen = {}
    for kind in (WARMUP, TIMED, WATCHED, PEAK):
        device.calls.clear()
        device.groups.clear()
        peaks: list[list[int]] = [[]]
        times, failure = runner.run([RoundStep(kind, 0)], peaks)
        assert failure is None
        seen[kind] = (dict(device.calls), list(device.groups), len(times), len(peaks[0]))
    assert seen == {
        WARMUP: ({}, [], 0, 0),
        # the block starts together (the device idle, a barrier on the group), its marks are read once at its end
        TIMED: ({"barrier": 1, "synchronize": 2, "mark": 2, "wait": 1}, [group], 1, 0),
        WATCHED: ({"mark": 2, "wait": 1}, [], 1, 0),  # this rank alone: no barrier, nothing synchronized
        PEAK: ({}, [], 0, 1),  # untimed; the peak meter's figure appended
    }


def test_a_plan_is_applied_where_the_steps_switch_and_where_none_is_known(workload, monkeypatch):
    applied = []
    monkeypatch.setattr(steps, "configure_plan", lambda model, plan, check: applied.append(plan))
    a, b = fsdp2_default(workload.model), fsdp2_default(workload.model)
    runner = WorkloadSteps(workload, [a, b])  # which plan the model has now is not known
    runner.run([RoundStep(WARMUP, 0), RoundStep(WARMUP, 0), RoundStep(WARMUP, 1), RoundStep(WARMUP, 1),
                RoundStep(WARMUP, 0)])
    assert [p is a for p in applied] == [True, False, True]
    applied.clear()
    WorkloadSteps(workload, [a, b], applied=0).run([RoundStep(WARMUP, 0)])
    assert applied == []


def test_a_step_that_raised_stops_the_peak_meter_it_began(workload, monkeypatch):
    runner = WorkloadSteps(workload, [fsdp2_default(workload.model)], applied=0)
    monkeypatch.setattr(steps, "train_step", lambda w, i: (_ for _ in ()).throw(RuntimeError("boom")))
    _, failure = runner.run([RoundStep(PEAK, 0)], [[]])
    assert failure is not None and failure.error == "RuntimeError: boom"
    assert not runner.side.meter.measuring and runner.side.meter._prof is None
    recorder = runner.side.recorder = StepFigures(workload.model, [workload.optimizer])  # a recording's peak step
    try:
        _, failure = runner.run([RoundStep(RECORD_PEAK, 0)], [[]])
        assert failure is not None and not recorder.meter.measuring and recorder.meter._prof is None
    finally:
        recorder.remove()
        runner.side.recorder = None


def test_the_peak_meter_starts_without_the_last_steps_gradients(workload):
    train_step(workload, 0)  # the optimizer's state exists and the gradients are alive after it
    with_grads = bytes_alive(workload.model, [workload.optimizer])
    grads = [p.grad for p in workload.model.parameters() if p.grad is not None]
    assert grads
    runner = WorkloadSteps(workload, [fsdp2_default(workload.model)], applied=0)
    meter, got = runner.side.meter, []
    end = meter.end
    meter.end = lambda: got.append(end()) or got[-1]
    peaks: list[list[int]] = [[]]
    runner.step(RoundStep(PEAK, 0), peaks)
    peak = got[0]
    assert peaks == [[peak.peak_bytes]]
    workload.optimizer.zero_grad(set_to_none=True)
    assert peak.start_bytes == bytes_alive(workload.model, [workload.optimizer]) < with_grads
    assert peak.peak_bytes > peak.start_bytes and peak.optimizer_temp_bytes > 0  # the optimizer hook opened its block


@dataclass
class FakeAllocator(Device):
    """A CUDA-like device whose allocator counters the test moves by hand (``alloc``, ``free``)."""

    type: str = "cuda"
    now: int = 0
    peak: int = 0
    reserved_peak: int = 0

    def synchronize(self) -> None:
        pass

    def alloc(self, n: int) -> None:
        self.now += n
        self.peak, self.reserved_peak = max(self.peak, self.now), max(self.reserved_peak, self.now + 8)

    def free(self, n: int) -> None:
        self.now -= n

    def reset_peak(self) -> None:
        self.peak, self.reserved_peak = self.now, self.now + 8

    def allocated(self) -> int:
        return self.now

    def peak_allocated(self) -> int:
        return self.peak

    def peak_reserved(self) -> int:
        return self.reserved_peak


def test_the_peak_meter_on_a_gpu_reads_the_allocator_around_the_optimizer_step(monkeypatch):
    """GPU: the step's peak is the larger of the peak before the optimizer step and the one after its reset; the
    optimizer's temporaries are what it allocated above what was alive when it began; a step with no optimizer step
    has none. No profiler runs."""
    fake = FakeAllocator(now=100)
    monkeypatch.setattr(peak_memory, "device_of", lambda _type: fake)
    model = nn.Linear(2, 2)

    class Temporaries(torch.optim.SGD):
        def step(self, closure=None):
            fake.alloc(40)  # the optimizer's temporaries, freed before it returns
            fake.free(40)
            return super().step(closure)

    optimizer = Temporaries(model.parameters(), lr=0.1)
    meter = PeakMeter(model, [optimizer])
    meter.begin()
    fake.alloc(50)  # forward's activations
    fake.free(50)
    fake.alloc(30)  # the gradients, alive into the optimizer step
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    assert meter.end() == PeakMemory(peak_bytes=170, start_bytes=100, optimizer_temp_bytes=40, reserved_bytes=178)
    assert meter._prof is None
    fake.free(30)
    meter.begin()
    fake.alloc(60)
    fake.free(60)
    assert meter.end() == PeakMemory(peak_bytes=160, start_bytes=100, optimizer_temp_bytes=0, reserved_bytes=168)


def test_the_traced_steps_run_under_one_trace_that_is_read_once(workload):
    """``RECORD_TRACE`` steps (runtime.recording.collective_trace): one profiler over them, each in its
    ``ProfilerStep#N`` range, read once into this rank's collectives (none at world size 1: FSDP2 all-gathers
    nothing there)."""
    from runtime.timing import RECORD_TRACE

    runner = WorkloadSteps(workload, [fsdp2_default(workload.model)], applied=0)
    figures = runner.side.recorder = StepFigures(workload.model, [workload.optimizer])
    try:
        runner.run_all([RoundStep(RECORD_TRACE, 0)] * 2)
        assert figures.trace.running and figures.trace.steps == 2
        assert figures.read_collectives() == [] and not figures.trace.running
        assert figures.read_collectives() == []
    finally:
        figures.remove()
        runner.side.recorder = None


def test_the_traced_steps_leave_a_users_profiler_alone(workload):
    """Under the user's own ``torch.profiler`` a second session would end theirs: nothing is traced, theirs goes on,
    and the collectives keep their isolated figures."""
    from torch.profiler import ProfilerActivity, profile

    from runtime.ranks.torch_private import profiler_running
    from runtime.timing import RECORD_TRACE

    runner = WorkloadSteps(workload, [fsdp2_default(workload.model)], applied=0)
    figures = runner.side.recorder = StepFigures(workload.model, [workload.optimizer])
    try:
        with profile(activities=[ProfilerActivity.CPU]):
            runner.run_all([RoundStep(RECORD_TRACE, 0)] * 2)
            assert profiler_running() and not figures.trace.running and figures.trace.refused
        assert figures.read_collectives() is None
    finally:
        figures.remove()
        runner.side.recorder = None
