"""Time and memory accounting of a step: trace events, allocations, and compute on the device.

[Note: Trace capacity]
A traced run writes its timeline into arrays sized from the profile. The
kernel writes no row past their end but keeps counting; when a plan needed
more rows (many prefetches, many allocations per module), the run is done
again with arrays of the exact size. Timing never depends on the trace, so
both runs agree. The check costs the untraced runs nothing: their placeholder
arrays are ``float32``, and for that type the kernel compiles writers that do
nothing (``_kernel.timeline.write_event``, ``numba.extending.overload``): even
a never-taken check in the hot path slows every step
(``docs/decisions/statistics-evidence.md``).
"""

from __future__ import annotations

from planner.simulation._kernel.state import (
    ALIVE,
    ALL_GATHER_ROW,
    COMPUTE_STREAM,
    COMPUTE_TOTAL,
    CPU,
    EVENTS,
    HELD,
    IN_FLIGHT,
    PEAK,
    PROCESS_GROUP,
    RESERVED_PEAK,
    SAMPLES,
    njit,
    overload,
    types,
)


def write_event(events, counters, kind, module, start, end):
    """Count a timeline slice and write it, unless past the last row ([Note: Trace capacity]).

    Compiled, the untraced run's placeholder (``float32``) gets a version that does nothing.
    """
    n = counters[EVENTS]
    if n < events.shape[0]:
        events[n, 0] = kind
        events[n, 1] = module
        events[n, 2] = start
        events[n, 3] = end
    counters[EVENTS] = n + 1


def write_sample(samples, counters, time, alive):
    """Count a memory sample and write it, unless past the last row; nothing for the placeholder, compiled."""
    n = counters[SAMPLES]
    if n < samples.shape[0]:
        samples[n, 0] = time
        samples[n, 1] = alive
    counters[SAMPLES] = n + 1


def delay_event(events, row, since, delay):
    """Move timeline slice ``row`` (an all-gather still in flight) ``delay`` ms later from ``since``; nothing for
    no row (-1), a row past the last, or, compiled, the untraced placeholder."""
    if 0 <= row < events.shape[0]:
        if events[row, 2] > since:
            events[row, 2] += delay
        events[row, 3] += delay


if overload is not None:

    @overload(delay_event, inline="always")
    def _delay_event_overload(events, row, since, delay):
        if events.dtype == types.float32:
            return lambda events, row, since, delay: None
        return delay_event

    @overload(write_event, inline="always")
    def _write_event_overload(events, counters, kind, module, start, end):
        if events.dtype == types.float32:  # the untraced placeholder
            return lambda events, counters, kind, module, start, end: None
        return write_event

    @overload(write_sample, inline="always")
    def _write_sample_overload(samples, counters, time, alive):
        if samples.dtype == types.float32:
            return lambda samples, counters, time, alive: None
        return write_sample


@njit(cache=True)
def event(events, counters, kind, module, start, end):
    """Append a timeline slice when traced; ``kind`` as in :mod:`.state`."""
    if events.shape[0] > 1:
        write_event(events, counters, kind, module, start, end)


@njit(cache=True)
def allocate(clock, counters, samples, delta):
    """Add ``delta`` bytes to the bytes alive, in issue order.

    [Note: Memory in program order] in :mod:`planner.simulation.simulator`.
    """
    alive = counters[ALIVE] + delta
    counters[ALIVE] = alive
    if alive > counters[PEAK]:
        counters[PEAK] = alive
    if alive + counters[HELD] > counters[RESERVED_PEAK]:
        counters[RESERVED_PEAK] = alive + counters[HELD]
    if samples.shape[0] > 1:  # past the last row: counted, not written ([Note: Trace capacity])
        n = counters[SAMPLES]
        if n < samples.shape[0]:
            samples[n, 0] = max(clock[CPU], clock[COMPUTE_STREAM])
            samples[n, 1] = alive
        counters[SAMPLES] = n + 1


@njit(cache=True)
def delay_in_flight(since, delay, clock, counters, in_flight, all_gather_end, module_state, events):
    """Every collective still in flight after ``since`` ends ``delay`` ms later.

    The process group runs them one after another, so queued ones start later too.
    """
    clock[PROCESS_GROUP] += delay
    for q in range(counters[IN_FLIGHT]):
        j = in_flight[q]
        if all_gather_end[j] > since:
            all_gather_end[j] += delay
            delay_event(events, module_state[j, ALL_GATHER_ROW], since, delay)


@njit(cache=True, inline="always")
def beside_all_gathers(start, end, cfg, clock, counters, in_flight, all_gather_end, module_state, events):
    """CPU: the end of work from ``start`` to ``end`` (compute, or a reduce-scatter on gloo's other worker) that runs
    beside the all-gathers in flight.

    [Note: CPU device] they share the cores, so for the overlapped work both progress at 1/overlap_slowdown of
    their speed. The work ends later by overlap * (slowdown - 1), and so does every all-gather still in flight
    (the process group runs them one after another).
    """
    if cfg.overlap_excess != 0.0 and clock[PROCESS_GROUP] > start:
        delay = (min(clock[PROCESS_GROUP], end) - start) * cfg.overlap_excess
        delay_in_flight(start, delay, clock, counters, in_flight, all_gather_end, module_state, events)
        return end + delay
    return end


@njit(cache=True)
def compute(i, kind, ms, cfg, clock, counters, in_flight, all_gather_end, module_state, events):
    """Run ``ms`` of compute for module ``i``: on the compute stream (GPU) or the issuing thread (CPU)."""
    if cfg.gpu:
        start = clock[COMPUTE_STREAM] if clock[COMPUTE_STREAM] > clock[CPU] else clock[CPU]
        end = start + ms
        clock[COMPUTE_STREAM] = end
    else:
        start = clock[CPU]
        end = beside_all_gathers(start, start + ms, cfg, clock, counters, in_flight, all_gather_end, module_state,
                                 events)
        clock[CPU] = end
    clock[COMPUTE_TOTAL] += end - start
    event(events, counters, kind, i, start, end)
