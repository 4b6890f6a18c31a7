"""A checkpointed block's recompute in a trace: forward ops inside its backward stretch.

Non-reentrant ``torch.utils.checkpoint`` re-runs the block's forward when backward first unpacks one of its
saved tensors, so the block's forward ops run again inside its backward stretch ([Note: Compute from a trace]
in :mod:`planner.traces.fsdp_steps`). Some ops only a forward calls: :data:`FORWARD_ONLY` (composite ops whose
backward formulas call ``aten::mm`` and the ``*_backward`` ops instead). Their span in a backward stretch is the
recompute; ops before the first of them (an RMS norm written as ``pow``/``mean``/``rsqrt``) are missed.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

from planner.traces.kineto import KinetoTrace, TraceEvent

FORWARD_ONLY = frozenset({"aten::linear", "aten::scaled_dot_product_attention", "aten::layer_norm", "aten::rms_norm",
                          "aten::group_norm", "aten::embedding", "aten::conv1d", "aten::conv2d"})


def recompute_in_backward(trace: KinetoTrace, segments: list[tuple],
                          threads: set[int | str | None]) -> tuple[dict[str, float], dict[str, int]]:
    """Per module, its recompute in backward: ms (the span from the first to the last :data:`FORWARD_ONLY` op of
    each backward stretch on CPU; on GPU the kernels launched in it) and bytes (the ``[memory]`` peak in the span
    above its start). Modules that recompute nothing are absent.

    Args:
        segments: the stretches of :func:`planner.traces.fsdp_steps._segments`: (start us, end us, phase, module,
            before-first-nested).
        threads: the threads that run FSDP2's labels (on GPU, backward runs on autograd's thread for the device).
    """
    ops = [e for e in trace.cpu if e.thread in threads and e.name in FORWARD_ONLY]
    starts = [e.ts for e in ops]
    events = [m for m in trace.memory if m.device == trace.device_type]
    times, totals = [m.ts for m in events], [m.total_allocated for m in events]
    ms: dict[str, float] = defaultdict(float)
    nbytes: dict[str, int] = defaultdict(int)
    for start, end, phase, module, _ in segments:
        if phase != "bwd" or module == "":
            continue
        inside = ops[bisect.bisect_left(starts, start):bisect.bisect_right(starts, end)]
        if not inside:
            continue
        span = TraceEvent("recompute", "span", inside[0].ts, max(e.end for e in inside) - inside[0].ts)
        ms[module] += trace.gpu_ms_launched_in(span) if trace.device_type == "cuda" else span.dur / 1e3
        first, last = bisect.bisect_left(times, span.ts), bisect.bisect_right(times, span.end)
        if last > first:
            at_start = totals[first - 1] if first > 0 else 0
            nbytes[module] = max(nbytes[module], max(totals[first:last]) - at_start)
    return dict(ms), dict(nbytes)
