"""runtime.recording.steps: the one step runner. What each kind of step asks of the device (a counting fake), a
plan applied only where the steps switch, and the peak meter starting without the last step's gradients."""

from __future__ import annotations

import pytest

from runtime.current import fsdp2_default
from runtime.ranks.device import CountingDevice
from runtime.recording import steps
from runtime.recording.peak_memory import bytes_alive, measure_peak
from runtime.recording.steps import WorkloadSteps
from runtime.reference_workloads import mlp
from runtime.timing import PEAK, TIMED, WARMUP, WATCHED, RoundStep
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
        TIMED: ({"barrier": 1, "synchronize": 2, "clock": 2}, [group], 1, 0),  # every rank together, on the group
        WATCHED: ({"synchronize": 2, "clock": 2}, [], 1, 0),  # this rank alone: no barrier
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


def test_the_peak_meter_starts_without_the_last_steps_gradients(workload):
    train_step(workload, 0)  # the optimizer's state exists and the gradients are alive after it
    with_grads = bytes_alive(workload.model, [workload.optimizer])
    grads = [p.grad for p in workload.model.parameters() if p.grad is not None]
    assert grads
    peak = measure_peak(workload, 1)
    workload.optimizer.zero_grad(set_to_none=True)
    assert peak.start_bytes == bytes_alive(workload.model, [workload.optimizer]) < with_grads
    assert peak.peak_bytes > peak.start_bytes and peak.optimizer_temp_bytes > 0  # the optimizer hook opened its block
