"""The device a rank runs on: the one place in ``runtime`` that reads the clock, waits for the device, takes a
barrier, records events and reads the allocator's memory counters.

Every timing and memory figure the runtime produces (the recorder's, the measured rounds', the in-loop tuner's)
goes through a :class:`Device`, so that a step's ms and a peak's bytes mean the same wherever they were taken, and
so that GPU-true timing (CUDA events on the right stream, no synchronization of the user's steps) changes one file.
``tests/test_architecture.py`` fails if ``time.perf_counter``, ``torch.cuda.synchronize``, ``torch.cuda.Event``,
a ``barrier`` or the allocator's counters appear anywhere else in ``runtime/``.

[Note: Which group a barrier uses]
A timed step starts on every rank together: a barrier, then the device synchronized, then the clock. The barrier
is on the group the caller passes: the tuner's gloo control group (``runtime.ranks.collectives``) wherever one
exists, never training's default group. On GPUs the default group is NCCL, whose ``barrier`` is an all-reduce
queued on a CUDA stream: it returns before the peers arrive unless the device is synchronized after it, and it
costs a kernel in the user's stream. Gloo's barrier returns when every rank reached it, on the host, with nothing
queued on the GPU. The default group is used only where no control group exists yet (a rank's set-up, a
recorder run outside a job), and then the device is synchronized after it. The device is synchronized before the
barrier as well: a rank whose GPU still runs the previous step's kernels would otherwise pass the barrier with its
peers and start the clock while that work is still queued.

[Note: Steps on the device's clock]
A training step is timed by two marks on the device's clock (:meth:`Device.mark`): on a GPU, CUDA events
(``enable_timing=True``) recorded on the current stream when the step starts and when it ends; on a CPU, the host
clock. A stream runs its work in order, so the start event completes when the device has finished everything queued
before the step (the previous step, the user's own work between steps) and the end event when it has finished the
step. The end event covers the step's collectives: FSDP2's final backward callback makes the current stream wait
for the last reduce-scatter (``FSDPState._root_post_backward_final_callback``: ``current_stream().wait_event(
reduce_scatter_state.event)``, ``torch/distributed/fsdp/_fully_shard/_fsdp_state.py`` in torch 2.13), and a
reduce-scatter issued with ``async_op=False`` makes its stream wait for ProcessGroupNCCL's own stream, so the
NCCL kernel is before that event; the optimizer step is on the current stream after it. The interval is therefore
the step's span on the device: the time its kernels kept the device busy, and any gap in which the device waited
for the host launching them.

Nothing waits for the device while steps run. Marks are read after the fact (:meth:`Device.spans_ms`): a raced
block's at its end, by one wait on its last end event (``Event.synchronize``, the host waiting for that event, not
for the whole device); the watch's when :meth:`Device.done` (``Event.query``) says they are complete, never by a
wait. What each kind of step costs on the device is in ``runtime.recording.steps`` ([Note: What a step costs the
device]).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from planner.artifacts.memory_budget import device_budget, device_memory_cap


class Device:
    """A rank's device: ``"cpu"`` (compute synchronous, memory read by the profiler elsewhere) or ``"cuda"``.

    Build one with :func:`device_of`. Times are host seconds (:meth:`clock`) or ms (:meth:`timed_ms`); memory is
    bytes of the caching allocator (CUDA only; 0 on CPU, whose peaks ``runtime.recording`` reads from the
    profiler).
    """

    type = "cpu"

    def clock(self) -> float:
        """The host clock, s (``time.perf_counter``)."""
        return time.perf_counter()

    def synchronize(self) -> None:
        """Wait for the work queued on the device (a no-op on CPU, where compute is synchronous)."""

    def barrier(self, group: Any = None) -> None:
        """Wait for every rank of ``group`` (``None``: training's default group) ([Note: Which group a barrier
        uses])."""
        dist.barrier(group=group)

    def monitored_barrier(self, timeout_s: float) -> None:
        """Wait for every rank of the default group, at most ``timeout_s``; gloo names a rank that did not come
        (``monitored_barrier``), other backends take a plain barrier.

        Raises:
            RuntimeError: a rank did not arrive in time (gloo).
        """
        import datetime

        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))
        else:
            dist.barrier()

    def mark(self) -> Any:
        """A point in time on the device's clock: host seconds on CPU, a recorded CUDA event on GPU (read back by
        :meth:`seconds`)."""
        return self.clock()

    def seconds(self, marks: list[Any]) -> list[float]:
        """The :meth:`mark` s as seconds since the first (waits for the device on GPU)."""
        return [m - marks[0] for m in marks] if marks else []

    def done(self, mark: Any) -> bool:
        """Whether the device has reached ``mark`` (CUDA: ``Event.query()``, which never waits; always on CPU)."""
        return True

    def wait(self, mark: Any) -> None:
        """Block the host until the device reaches ``mark`` (CUDA: ``Event.synchronize()``, that event alone, not
        the whole device; nothing on CPU)."""

    def spans_ms(self, spans: list[tuple[Any, Any]], wait: bool = True) -> list[float]:
        """The ms from each ``(start, end)`` pair of :meth:`mark` s to its end ([Note: Steps on the device's
        clock]).

        The marks of one stream complete in order, so one :meth:`wait` on the last end (``wait``) makes every pair
        readable; without it the caller must know they are complete (:meth:`done` on the last end).

        Raises:
            RuntimeError: on GPU, ``wait`` is false and a mark is not complete (CUDA's ``cudaErrorNotReady``).
        """
        if spans and wait:
            self.wait(spans[-1][1])
        return [self._interval_ms(start, end) for start, end in spans]

    def _interval_ms(self, start: Any, end: Any) -> float:
        return (end - start) * 1e3

    def align(self, group: Any = None) -> None:
        """Start a timed stretch on every rank of ``group`` together: the device synchronized (nothing queued before
        is left), a barrier ([Note: Which group a barrier uses]), the device synchronized again (a barrier on a GPU
        group is a kernel)."""
        self.synchronize()
        self.barrier(group)
        self.synchronize()

    def stream_event(self, where: torch.device) -> Any:
        """An event recorded now on the current stream of ``where`` (what FSDP2's ``set_post_optim_event`` waits
        on); ``None`` on CPU, which has no events."""
        return None

    def reset_peak(self) -> None:
        """Start a new peak of the allocator's bytes (CUDA)."""

    def allocated(self) -> int:
        """Bytes the allocator holds for tensors now (CUDA; 0 on CPU)."""
        return 0

    def peak_allocated(self) -> int:
        """The most bytes the allocator held since :meth:`reset_peak` (CUDA; 0 on CPU)."""
        return 0

    def reserved(self) -> int:
        """Bytes the allocator reserved from the device now (CUDA; 0 on CPU)."""
        return 0

    def peak_reserved(self) -> int:
        """The most bytes the allocator reserved since :meth:`reset_peak` (CUDA; 0 on CPU)."""
        return 0

    def free_and_total(self) -> tuple[int, int]:
        """``(free, total)`` bytes of the device's memory (CUDA: ``mem_get_info``, other processes counted).

        Raises:
            NotImplementedError: on CPU, which has no device memory of its own.
        """
        raise NotImplementedError("a CPU has no device memory to read")

    def release_cache(self) -> None:
        """Give back to the device what the allocator caches but no tensor holds (CUDA: ``torch.cuda.empty_cache``;
        nothing on CPU). After the recorder's isolated passes, whose blocks are sized for modules held unsharded
        together: the job's next steps take what they need afresh instead of holding those."""

    def capacity_bytes(self) -> int | None:
        """The bytes this rank may reach, for the recorder's isolated passes ([Note: Profiling within the device's
        memory] in ``planner.study.isolation``): on CPU the cap ``PREFETCH_PLANNER_DEVICE_MEMORY`` sets, else
        ``None``.

        Raises:
            PlannerError: the setting is not a size.
        """
        return device_memory_cap()

    def start(self, group: Any = None) -> float:
        """The clock at the start of a timed stretch, s, every rank of ``group`` there from an idle device
        (:meth:`align`)."""
        self.align(group)
        return self.clock()

    def elapsed_ms(self, t0: float) -> float:
        """Ms since :meth:`start` returned ``t0``, the device synchronized first, so on GPU the kernels queued
        since are in the time."""
        self.synchronize()
        return (self.clock() - t0) * 1e3

    def timed_ms(self, run: Callable[[], object], group: Any = None) -> float:
        """This rank's wall time of ``run()``, ms, every rank of ``group`` starting together (:meth:`start`,
        :meth:`elapsed_ms`)."""
        t0 = self.start(group)
        run()
        return self.elapsed_ms(t0)


class CUDADevice(Device):
    """The current CUDA device (``torch.cuda``)."""

    type = "cuda"

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, marks: list[Any]) -> list[float]:
        if not marks:
            return []
        torch.cuda.synchronize()
        return [marks[0].elapsed_time(m) / 1e3 for m in marks]

    def done(self, mark: Any) -> bool:
        return bool(mark.query())

    def wait(self, mark: Any) -> None:
        mark.synchronize()

    def _interval_ms(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end))

    def stream_event(self, where: torch.device) -> Any:
        return torch.cuda.current_stream(where).record_event()

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def allocated(self) -> int:
        return torch.cuda.memory_allocated()

    def peak_allocated(self) -> int:
        return torch.cuda.max_memory_allocated()

    def reserved(self) -> int:
        return torch.cuda.memory_reserved()

    def peak_reserved(self) -> int:
        return torch.cuda.max_memory_reserved()

    def free_and_total(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info()
        return int(free), int(total)

    def release_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_fraction(self) -> float:
        """The share of the device's memory this process's allocator is held to
        (``torch.cuda.set_per_process_memory_fraction``; 1.0 where this torch cannot say)."""
        read = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        return float(read()) if read is not None else 1.0

    def capacity_bytes(self) -> int | None:
        """What the caching allocator holds plus what the device has free, within the process's memory fraction,
        less a margin (``planner.artifacts.memory_budget.device_budget``); the setting's cap where it is
        tighter."""
        free, total = self.free_and_total()
        reachable = int(device_budget(free, self.reserved(), total, self.memory_fraction()).value)
        cap = device_memory_cap()
        return reachable if cap is None else min(reachable, cap)


_DEVICES = {"cpu": Device(), "cuda": CUDADevice()}


def device_of(device_type: str) -> Device:
    """The :class:`Device` of ``device_type`` (``"cpu"`` or ``"cuda"``; any other type times as the CPU does).

    The devices hold no state: one of each serves every caller.
    """
    return _DEVICES.get(device_type, _DEVICES["cpu"])


@dataclass
class CountingDevice(Device):
    """A CPU device that counts what it is asked to do, for tests: ``calls["barrier"]``, ``calls["synchronize"]``
    and so on, and the groups its barriers took (``groups``)."""

    type: str = "cpu"
    calls: dict[str, int] = field(default_factory=dict)
    groups: list[Any] = field(default_factory=list)

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def clock(self) -> float:
        self._count("clock")
        return super().clock()

    def synchronize(self) -> None:
        self._count("synchronize")

    def mark(self) -> Any:
        self._count("mark")
        return Device.clock(self)

    def wait(self, mark: Any) -> None:
        self._count("wait")

    def done(self, mark: Any) -> bool:
        self._count("done")
        return True

    def release_cache(self) -> None:
        self._count("release_cache")

    def barrier(self, group: Any = None) -> None:
        self._count("barrier")
        self.groups.append(group)
        super().barrier(group)
