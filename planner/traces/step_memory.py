"""One step's memory from a trace's ``[memory]`` events: the peak, the optimizer's temporaries, each module's
activations and its backward's peak (:func:`step_memory`, for :mod:`planner.traces.fsdp_steps`)."""

from __future__ import annotations

import bisect
import itertools

from planner.traces.kineto import KinetoTrace, TraceEvent


def step_memory(trace: KinetoTrace, window: TraceEvent, labels: list, optimizer: TraceEvent | None,
                parent: dict[str, str], segments: list[tuple]) -> dict:
    """The memory figures of :class:`planner.traces.fsdp_steps.RankStep`, by field name (``{}`` without memory
    events): ``start_bytes``, ``peak_above_start_bytes``, ``optimizer_temp_bytes`` (with an optimizer step),
    ``activation_bytes``, ``backward_peak_bytes``, ``root_forward_post_bytes`` and ``root_backward_post_bytes``.

    Args:
        labels: the step's FSDP2 labels (``kind``, ``fqn``, ``event``); ``parent``: module nesting (child -> parent);
        segments: the ``(start, end, phase, module, before-first-nested)`` stretches of the walk.
    """
    events = [m for m in trace.memory if m.device == trace.device_type]
    if not events:
        return {}
    ts = [m.ts for m in events]

    def total_at(t: float) -> int:  # before the file's first event: what that event found
        i = bisect.bisect_right(ts, t) - 1
        return events[i].total_allocated if i >= 0 else events[0].total_allocated - events[0].bytes

    inside = [m.total_allocated for m in events if window.contains(m.ts)]
    start = total_at(window.ts)
    out = {"start_bytes": start, "peak_above_start_bytes": max(inside, default=start) - start}
    if optimizer is not None:
        during = [m.total_allocated for m in events if optimizer.contains(m.ts)]
        out["optimizer_temp_bytes"] = max(0, max(during, default=0) - total_at(optimizer.ts))
    first_pre = {lb.fqn: lb.event for lb in reversed(labels) if lb.kind == "pre_forward"}
    first_post = {lb.fqn: lb.event for lb in reversed(labels) if lb.kind == "post_forward"}
    net = {f: total_at(first_post[f].end) - total_at(first_pre[f].ts) for f in first_pre if f in first_post}
    exclusive = dict(net)
    for child, par in parent.items():
        if child in net and par in exclusive:
            exclusive[par] -= net[child]
    # What the loop frees or keeps between the root's forward and its backward is the root's: e.g. the logits of a
    # loss computed in the root's forward, returned in its output and dropped once the loss is read (HF's
    # ``model(...).loss``; 500 MiB in the GPU Llama), or a loss computed in the loop (torchtitan) that saves its own.
    backward = next((lb.event for lb in labels if lb.kind == "pre_backward" and lb.fqn == ""), None)
    if "" in exclusive and backward is not None:
        exclusive[""] += total_at(backward.ts) - total_at(first_post[""].end)
    out["activation_bytes"] = {f: max(0, b) for f, b in exclusive.items()}
    out["backward_peak_bytes"] = _backward_peaks(events, total_at, segments)
    # the root's forward stretches after its children's (the final norm, the LM head, the loss), and the loop's up to
    # the root's backward, in the first microbatch: the part of its activations its backward frees before its
    # children's ([Note: The root's saved tensors in two parts] in runtime/recording/compute_timer.py)
    first_forward = itertools.takewhile(lambda seg: seg[2] == "fwd", segments)
    out["root_forward_post_bytes"] = max(0, sum(total_at(end) - total_at(start) for start, end, phase, module, pre
                                                in first_forward if module == "" and not pre))
    # the root's stretches after its children's backward (the embedding's backward) leave its gradient allocated
    out["root_backward_post_bytes"] = max(0, sum(total_at(end) - total_at(start) for start, end, phase, module, pre
                                                 in segments if phase == "bwd" and module == "" and not pre))
    return out


def _backward_peaks(events: list, total_at, segments: list[tuple]) -> dict[str, int]:
    """Per module, the most bytes allocated in its backward stretches before its first nested module's, above the
    level where its run of such stretches began (a module's stretches back to back, as a root's between its own
    labels, are one run); the max over the step's runs."""
    ts = [m.ts for m in events]
    peaks: dict[str, int] = {}
    last, base = None, 0
    for start, end, phase, module, pre in segments:
        if phase != "bwd" or not pre:
            last = None
            continue
        if module != last:
            base, last = total_at(start), module
        lo, hi = bisect.bisect_right(ts, start), bisect.bisect_right(ts, end)
        peak = max([total_at(start)] + [events[i].total_allocated for i in range(lo, hi)])
        peaks[module] = max(peaks.get(module, 0), peak - base)
    return peaks
