"""The compute stream's time across host spans of a GPU trace: what CUDA events at a span's two ends would read.

The recorder times a module's compute with CUDA events recorded at its hooks
(``runtime.recording.compute_timer.ComputeTimer``). An event recorded at host time t
completes at the later of t and the end of the work launched on its stream
before t (``cudaEventRecord``). So across a host span the stream's time is its
kernels' time when the host runs ahead of the GPU, and the host's time when
the GPU waits for launches ([Note: Compute from a trace] in
:mod:`planner.traces.fsdp_steps`). A launch and its kernel share a
correlation id (:class:`planner.traces.kineto.KinetoTrace`).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable

from planner.traces.kineto import KinetoTrace, TraceEvent


def stream_ms(trace: KinetoTrace, clock: Callable[[float], float], start: float, end: float,
              kernels: list[TraceEvent]) -> float:
    """The compute stream's time (ms) across the host span ``[start, end]`` (us) that launched ``kernels`` (by start).

    From the stream's ``clock`` at ``start`` (:meth:`KinetoTrace.stream_clock`), each kernel adds its duration and
    the time the stream sat idle waiting for its launch; a kernel launched before the stream got to it but started
    later waited on another stream (an all-gather), which is not compute. The host's time after the last kernel
    ends counts too (an event recorded at ``end`` completes then).
    """
    t, total = clock(start), 0.0
    for k in kernels:
        total += max(0.0, min(k.ts, trace.launches[k.correlation]) - t) + k.dur
        t = max(t, k.end)
    return (total + max(0.0, end - t)) / 1e3


def stretches_ms(trace: KinetoTrace, spans: list[tuple[float, float]]
                 ) -> tuple[list[float], Callable[[TraceEvent], float]]:
    """Per host span ``(start, end)`` (us; by start, not overlapping) the compute stream's time (ms), and
    ``across(event)``: the same for another host event (the optimizer step) on the streams the spans launched on.

    The compute streams are those the spans' kernels ran on (FSDP2's collectives run on their own streams and are
    launched inside its labels, between the spans).
    """
    starts = [s for s, _ in spans]
    launched: dict[int, list[TraceEvent]] = defaultdict(list)  # span -> its kernels, by start
    for k in trace.gpu:
        at = trace.launches.get(k.correlation) if k.correlation is not None else None
        i = bisect.bisect_right(starts, at) - 1 if at is not None else -1
        if i >= 0 and at <= spans[i][1]:
            launched[i].append(k)
    streams = {k.stream for ks in launched.values() for k in ks}
    clock = trace.stream_clock(streams)

    def across(event: TraceEvent) -> float:
        kernels = [k for k in trace.launched_in(event) if k.stream in streams]
        return stream_ms(trace, clock, event.ts, event.end, kernels)

    return [stream_ms(trace, clock, s, e, launched[i]) for i, (s, e) in enumerate(spans)], across
