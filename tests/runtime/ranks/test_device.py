"""runtime.ranks.device: the one place that reads the clock, waits for the device and takes barriers."""

from __future__ import annotations

import time

import pytest

from runtime.ranks.device import CountingDevice, CUDADevice, Device, device_of


def test_a_timed_call_starts_after_the_device_idles_and_a_barrier_on_the_group_given_and_waits_for_the_device(mesh):
    device = CountingDevice()
    group = object()
    device.barrier = lambda g=None: (device._count("barrier"), device.groups.append(g))  # no second rank here
    ms = device.timed_ms(lambda: time.sleep(0.01), group)
    assert ms >= 10.0
    # synchronized before the barrier (a rank's queued work is not in its peers' time) and after it, then at the end
    assert device.calls == {"barrier": 1, "synchronize": 3, "clock": 2} and device.groups == [group]


def test_the_cpu_device_marks_host_seconds_and_has_no_device_memory():
    cpu = device_of("cpu")
    assert type(cpu) is Device and cpu.type == "cpu" and device_of("meta") is cpu
    marks = [cpu.mark(), cpu.mark()]
    seconds = cpu.seconds(marks)
    assert seconds[0] == 0.0 and seconds[1] >= 0.0 and cpu.seconds([]) == []
    assert (cpu.allocated(), cpu.peak_allocated(), cpu.reserved(), cpu.peak_reserved()) == (0, 0, 0, 0)
    assert cpu.stream_event(None) is None
    assert cpu.done(marks[1]) and cpu.spans_ms([(marks[0], marks[1])]) == [(marks[1] - marks[0]) * 1e3]
    with pytest.raises(NotImplementedError, match="no device memory"):
        cpu.free_and_total()


def test_the_cuda_device_is_one_object_of_its_own_type():
    assert isinstance(device_of("cuda"), CUDADevice) and device_of("cuda") is device_of("cuda")
    assert device_of("cuda").type == "cuda"


def test_a_real_barrier_on_one_rank_returns(mesh):
    device = CountingDevice()
    device.barrier()
    device.monitored_barrier(5.0)
    assert device.calls["barrier"] == 1 and device.groups == [None]
