"""FSDP2's work in one rank's trace, step by step: module windows, compute, collectives, memory.

FSDP2 labels its work with ``record_function`` (torch 2.13, ``_fsdp_state.py`` and ``_fsdp_param_group.py``):
``FSDP::root_pre_forward``, ``FSDP::pre_forward (fqn)``, ``FSDP::post_forward (fqn)``, ``FSDP::pre_backward (fqn)``,
``FSDP::post_backward_accumulate|reshard|rs_wait|reduce (fqn)``, ``FSDP::root_post_backward_callback``,
``FSDP::all_gather (fqn)``, ``FSDP::all_gather_copy_out (fqn)``, ``FSDP::forward_prefetch for fqn`` and
``FSDP::backward_prefetch for fqn``; the root's labels carry no name, or ``()``.

[Note: Compute from a trace]
The labels are the only time FSDP2 works on the loop's thread (on GPU, backward's labels run on autograd's thread
for the device); what runs between them is the model's own work. A walk over the top-level labels
(:func:`_segments`) keeps a stack of the modules in forward (pushed at the end of ``pre_forward``, popped at
``post_forward``) and in backward (pushed at the end of ``pre_backward``, popped at the first ``post_backward_*``),
and gives every stretch between labels to the module on top (the root when the stack is empty, e.g. the loss). That
is the recorder's rule: compute exclusive of nested FSDP modules, with the parameters unsharded, so no communication
inside. On CPU a stretch's wall time is the compute. On GPU it is the compute stream's time across the stretch, what
CUDA events recorded at its two ends measure (the recorder's timer; :mod:`planner.traces.stream_time`): an event
recorded at host time t completes at the later of t and the end of the work launched on the stream before t (a
launch and its kernel share a correlation id). So a stretch that launches faster than the GPU runs counts its
kernels' time, and one that the host cannot feed (small kernels) counts its host time.
Activation checkpointing shows as forward ops inside a module's backward stretch (``torch.utils.checkpoint``
re-runs the block when backward first unpacks a saved tensor): ops that only a forward calls (``FORWARD_ONLY``:
``aten::linear``, ``aten::scaled_dot_product_attention``, ...; backward formulas call ``aten::mm`` and the
``*_backward`` ops). A module's recompute is the span from the first to the last of them in each of its backward
stretches (on GPU, the kernels launched there), part of its backward compute; the ``[memory]`` peak within the
span above its start is what the recompute holds (:mod:`planner.traces.recompute`).
A collective is the gloo work (``gloo:*``, its own thread) or the NCCL kernel (its own stream) that the
``c10d::`` call, or the launch, inside the ``FSDP::all_gather`` or ``FSDP::post_backward_reduce`` label started.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

from planner.errors import TraceFormatError
from planner.traces.kineto import DTYPE_BYTES, KinetoTrace, TraceEvent
from planner.traces.recompute import recompute_in_backward
from planner.traces.step_memory import step_memory
from planner.traces.stream_time import stretches_ms

LABEL = re.compile(r"^FSDP::(\w+)(?: \((.*)\))?$")
POST_BACKWARD = ("post_backward_accumulate", "post_backward_reshard", "post_backward_rs_wait", "post_backward_reduce")
ALL_GATHER_OPS = ("c10d::_allgather_base_", "c10d::allgather_into_tensor_coalesced", "c10d::allgather_")
# gloo's work by collective: its reduce-scatter of a flat tensor runs as an all-reduce (``gloo:all_reduce``); the
# name keeps a reduce-scatter from matching the prefetch all-gather that gloo runs beside it.
GLOO_WORK = {"all_gather": ("gloo:all_gather",), "reduce_scatter": ("gloo:reduce_scatter", "gloo:all_reduce")}
# [Note: gloo's work after its call]
# A ``c10d::`` call on gloo only enqueues the work (after its own input copy, for a reduce-scatter); a gloo thread
# runs it, and the loop waits on it later: inside the label for a reduce-scatter and a sync all-gather (the
# ``torch.distributed`` wrapper's ``wait()``), in ``FSDP::all_gather_copy_out`` for an async one. The work often
# starts a few us after the call returned, e.g. a ``c10d::_reduce_scatter_base_`` that returns inside its label
# before the ``gloo:all_reduce`` it enqueued begins.
# Matched only inside the call, those calls took the call (the input copy) for the transfer and the transfer
# for a copy: their bare figure lost the transfer, and their full one kept the wait for the late rank.
# An async all-gather's copy-out label waits for the transfer before it copies: only its part after the transfer
# is copy (else the transfer counts twice).
REDUCE_SCATTER_OPS = ("c10d::_reduce_scatter_base_", "c10d::reduce_scatter_tensor_coalesced", "c10d::reduce_scatter_")


@dataclass(frozen=True)
class Collective:
    """One all-gather or reduce-scatter of one module in one step.

    Attributes:
        kind: ``"all_gather"`` (with its copy-out) or ``"reduce_scatter"``.
        ordinal: the n-th collective of this module and kind in the step (0-based): ranks' calls pair up by it.
        ms: this rank's time: the transfer (gloo work, or the NCCL kernel and copies), waiting for peers
            included, plus ``host_ms``.
        start_us, end_us: the gloo work's or the kernels' start and end on the host clock (``base_us`` added).
        host_ms: this rank's FSDP2 work for the call outside the transfer, ms: the all-gather's copy-out; on CPU
            also the copy-in before the transfer (``foreach_all_gather``'s, ``foreach_reduce``'s ``chunk_cat`` and
            gloo's own input copy) and, for a reduce-scatter, the copy into the sharded gradient after it (the
            thread waits for gloo between). On GPU the copy-in's kernels are in the transfer's span.
        bytes: all-gather output bytes (unsharded, padded), reduce-scatter input bytes; ``None`` without shapes.
        dtype_bytes: bytes per element; ``None`` without shapes.
        call_copy_ms: the part of ``host_ms`` inside the ``c10d::`` call before the transfer (gloo's own input copy),
            ms; 0 on GPU. ``call_copy_ms`` plus the transfer is what a bare call of the collective on preallocated
            buffers times, without FSDP2's copies around it (the recorder's reduce-scatter,
            ``runtime.recording.collective_timer.collective_rounds``).
        kernel_ms: the transfer's own time on its own clock, waiting for peers included, ms: on GPU the NCCL
            kernel's start to end on NCCL's stream (no copy, no time queued behind another collective), on CPU the
            gloo work's span on its thread ([Note: Collectives on NCCL's clock] in
            :mod:`planner.traces.in_step_collectives`).
    """

    module: str
    kind: str
    ordinal: int
    ms: float
    bytes: int | None
    dtype_bytes: int | None
    start_us: float = 0.0
    end_us: float = 0.0
    host_ms: float = 0.0
    call_copy_ms: float = 0.0
    kernel_ms: float = 0.0


@dataclass(frozen=True)
class RankStep:
    """One rank's figures of one step (``ProfilerStep#N``), ms and bytes. Module times are totals over the step's
    microbatches.

    Attributes:
        number: N of ``ProfilerStep#N`` (0 when the trace has no step ranges: the whole trace is one step).
        pre_forward_order, post_forward_order: the first microbatch's, with multiplicity, root included.
        resharded: modules all-gathered again in backward (``reshard_after_forward`` was on).
        optimizer: the ``Optimizer.step#Name.step`` label's ``Name``, or ``None``.
        peak_above_start_bytes: the most bytes allocated above the step's start; ``None`` without memory events.
        start_bytes: ``Total Allocated`` at step start: before the file's first memory event, that event's total
            less its own ``Bytes`` (a file of a later profiler cycle starts where the counter stood, and on CPU that
            counter, the profiler's own, counts only what it saw allocated, never freeing what it saw allocated
            while not profiling, so it climbs from cycle to cycle: only differences within a step are bytes).
        activation_bytes: first microbatch: bytes each module's forward left allocated, exclusive of nested modules;
            the root's also with what the loop freed or allocated between the root's forward and its backward.
        recompute_ms: per checkpointed module, its recompute inside its backward (part of ``bwd_ms``).
        recompute_bytes: per checkpointed module, the most bytes allocated during its recompute above its start.
        backward_peak_bytes: per module, the most bytes allocated in its backward stretches before its first nested
            module's, above those allocated when the stretch began (after its ``pre_backward`` label); the
            recorder's figure of the same name ([Note: Backward temporaries] in ``runtime/recording/compute_timer.py``).
        root_forward_post_bytes: the bytes the root's forward stretches after its children's leave allocated (its
            final norm's, LM head's and loss's), with what the loop freed or allocated between the root's forward
            and its backward: ``ModuleProfile.activation_post_bytes``; ``None`` without memory events.
        root_backward_post_bytes: the bytes the root's backward stretches after its children's leave allocated
            (the embedding's gradient): ``ModuleProfile.backward_post_grad_bytes``; ``None`` without memory events.
        path: the trace file the step is from.
    """

    number: int
    step_ms: float
    microbatches: int
    pre_forward_order: tuple[str, ...]
    post_forward_order: tuple[str, ...]
    fwd_ms: dict[str, float]
    bwd_ms: dict[str, float]
    fwd_pre_ms: dict[str, float]
    bwd_pre_ms: dict[str, float]
    collectives: tuple[Collective, ...]
    resharded: frozenset[str]
    optimizer: str | None = None
    optimizer_ms: float | None = None
    optimizer_temp_bytes: int | None = None
    peak_above_start_bytes: int | None = None
    start_bytes: int | None = None
    activation_bytes: dict[str, int] = field(default_factory=dict)
    recompute_ms: dict[str, float] = field(default_factory=dict)
    recompute_bytes: dict[str, int] = field(default_factory=dict)
    backward_peak_bytes: dict[str, int] = field(default_factory=dict)
    root_forward_post_bytes: int | None = None
    root_backward_post_bytes: int | None = None
    path: str = ""


@dataclass(frozen=True)
class _Label:
    kind: str
    fqn: str
    event: TraceEvent


def fsdp_label(event: TraceEvent) -> tuple[str, str] | None:
    """``(kind, fqn)`` of an FSDP2 label (root: ``""``), or ``None`` for other events and the prefetch labels."""
    m = LABEL.match(event.name)
    return (m.group(1), m.group(2) or "") if m else None


def rank_steps(trace: KinetoTrace) -> list[RankStep]:
    """Every step of the trace that ran FSDP2's forward and backward.

    Raises:
        TraceFormatError: the trace holds no FSDP2 label, or no step with a whole forward and backward.
    """
    labels = [_Label(*k, e) for e in trace.cpu if (k := fsdp_label(e)) is not None]
    if not labels:
        raise TraceFormatError(
            f"trace {trace.path!r} has no FSDP2 labels (FSDP::pre_forward, FSDP::all_gather, ...; it holds "
            f"{trace.summary()}): profile steps of a model wrapped with fully_shard, with the CPU activity on")
    # The training loop's thread runs the forward labels. Backward's run there on CPU, and on GPU on autograd's
    # thread for the device (``torch/csrc/autograd/engine.cpp``: one worker thread per device); labels of both
    # threads interleave by time, as the loop's thread waits in ``backward()``.
    forward = [lb for lb in labels if lb.kind in ("root_pre_forward", "pre_forward")] or labels
    main = max({lb.event.thread for lb in forward}, key=lambda t: sum(lb.event.thread == t for lb in forward))
    windows = [(int(e.name.split("#")[1]), e) for e in trace.cpu if e.name.startswith("ProfilerStep#")
               and e.thread == main and e.name.split("#")[1].isdigit()]
    if not windows:
        start = min(lb.event.ts for lb in labels)
        end = max([lb.event.end for lb in labels] + [e.end for e in trace.cpu if e.name.startswith("Optimizer.step#")])
        windows = [(0, TraceEvent("whole trace", "user_annotation", start, end - start, thread=main))]
    steps = []
    for number, window in windows:
        inside = [lb for lb in labels if window.ts <= lb.event.ts <= window.end]
        kinds = {lb.kind for lb in inside}
        if "root_pre_forward" in kinds and "root_post_backward_callback" in kinds:
            steps.append(_step(trace, number, window, inside, main))
    if not steps:
        raise TraceFormatError(f"trace {trace.path!r} holds no whole FSDP2 step (root_pre_forward through "
                               "root_post_backward_callback); profile at least one full training step")
    return steps


def _top_level(labels: list[_Label]) -> list[_Label]:
    out: list[_Label] = []
    for lb in labels:
        if not out or lb.event.ts >= out[-1].event.end:
            out.append(lb)
    return out


def _segments(labels: list[_Label], window: TraceEvent):
    """The walk of [Note: Compute from a trace]: (start, end, phase, module, before-first-nested) stretches, the
    orders, the microbatch count and the first microbatch's module nesting (child -> parent)."""
    segments: list = []  # (start, end, phase, module, before-first-nested)
    stack: list[str] = []  # the FSDP modules open at this label, outermost first
    phase: str | None = None  # "fwd", "bwd", or None between them
    t = None  # where the open stretch started
    pre_order: list[str] = []
    post_order: list[str] = []
    parent: dict[str, str] = {}
    nested: set[str] = set()
    microbatches = 0
    for lb in _top_level(labels):
        if phase is not None and t is not None and lb.event.ts > t:
            m = stack[-1] if stack else ""
            segments.append((t, lb.event.ts, phase, m, (phase, m) not in nested))
        kind, fqn = lb.kind, lb.fqn
        if kind == "root_pre_forward":
            phase, stack, nested = "fwd", [], set()
            microbatches += 1
        elif kind == "pre_forward":
            if stack:
                nested.add(("fwd", stack[-1]))
                parent.setdefault(fqn, stack[-1])
            stack.append(fqn)
            if microbatches == 1:
                pre_order.append(fqn)
        elif kind == "post_forward":
            if fqn in stack:
                stack.remove(fqn)
            if microbatches == 1:
                post_order.append(fqn)
        elif kind == "pre_backward":
            if phase != "bwd":
                phase, stack = "bwd", [""]
            if stack and stack[-1] != fqn:
                nested.add(("bwd", stack[-1]))
            if fqn not in stack:
                stack.append(fqn)
        elif kind in POST_BACKWARD and fqn in stack and fqn != "":
            stack.remove(fqn)
        elif kind == "root_post_backward_callback":
            phase, stack = None, []
        t = lb.event.end
    return segments, tuple(pre_order), tuple(post_order), microbatches, parent


def _step(trace: KinetoTrace, number: int, window: TraceEvent, labels: list[_Label], main) -> RankStep:
    segments, pre_order, post_order, microbatches, parent = _segments(labels, window)
    times = {k: defaultdict(float) for k in ("fwd", "bwd", "fwd_pre", "bwd_pre")}

    def credit(phase: str, module: str, pre: bool, ms: float) -> None:
        times[phase][module] += ms
        if pre:
            times[phase + "_pre"][module] += ms

    if trace.device_type == "cuda":  # [Note: Compute from a trace]: the compute stream's time across a stretch
        stretch, across = stretches_ms(trace, [(start, end) for start, end, *_ in segments])
    else:  # on CPU a stretch is its wall time, and an event's time is its own duration
        stretch = [(end - start) / 1e3 for start, end, *_ in segments]

        def across(event):
            return event.dur / 1e3
    for (_, _, phase, module, pre), ms in zip(segments, stretch, strict=True):
        credit(phase, module, pre, ms)
    resharded = frozenset(lb.fqn for lb in labels if lb.kind == "all_gather_copy_out"
                          and any(p.kind == "pre_backward" and p.event.contains(lb.event.ts) for p in labels))
    optimizer = next((e for e in trace.cpu if e.name.startswith("Optimizer.step#") and e.thread == main
                      and window.contains(e.ts)), None)
    memory = step_memory(trace, window, labels, optimizer, parent, segments)
    recompute_ms, recompute_bytes = recompute_in_backward(trace, segments, {lb.event.thread for lb in labels})
    return RankStep(
        number=number, step_ms=window.dur / 1e3, microbatches=max(1, microbatches), pre_forward_order=pre_order,
        post_forward_order=post_order, fwd_ms=dict(times["fwd"]), bwd_ms=dict(times["bwd"]),
        fwd_pre_ms=dict(times["fwd_pre"]), bwd_pre_ms=dict(times["bwd_pre"]),
        collectives=tuple(_collectives(trace, labels)), resharded=resharded,
        optimizer=optimizer.name.split("#")[1].split(".")[0] if optimizer else None,
        optimizer_ms=across(optimizer) if optimizer else None, recompute_ms=recompute_ms,
        recompute_bytes=recompute_bytes, path=trace.path, **memory,
    )


def _collectives(trace: KinetoTrace, labels: list[_Label]) -> list[Collective]:
    out, count = [], defaultdict(int)
    copy_outs = defaultdict(list)
    claimed: set[tuple] = set()  # gloo works already matched to an earlier call: (start, thread)
    for lb in labels:
        if lb.kind == "all_gather_copy_out":
            copy_outs[lb.fqn].append(lb.event)
    for lb in labels:
        if lb.kind not in ("all_gather", "post_backward_reduce"):
            continue
        kind = "all_gather" if lb.kind == "all_gather" else "reduce_scatter"
        copy = next((c for c in copy_outs[lb.fqn] if c.ts >= lb.event.ts), None) if kind == "all_gather" else None
        # where the loop waits on the work: in the label (a reduce-scatter, a sync all-gather) or in the copy-out
        until = max(lb.event.end, copy.end) if copy is not None else lb.event.end
        found = _gpu_collective(trace, lb.event, kind) if trace.device_type == "cuda" else \
            _gloo_collective(trace, lb.event, kind, until, claimed)
        if found is None:
            continue
        (start, end), nbytes, dtype_bytes, host_ms, call_copy_ms, kernel_ms = found
        if copy is not None:  # on CPU its part after the transfer: an async all-gather's copy-out first waits for it
            copy_outs[lb.fqn].remove(copy)
            host_ms += trace.gpu_ms_launched_in(copy) if trace.device_type == "cuda" else \
                max(0.0, copy.end - max(copy.ts, end)) / 1e3
        out.append(Collective(lb.fqn, kind, count[(lb.fqn, kind)], (end - start) / 1e3 + host_ms, nbytes,
                              dtype_bytes, start + trace.base_us, end + trace.base_us, host_ms, call_copy_ms,
                              kernel_ms))
        count[(lb.fqn, kind)] += 1
    return out


def _gloo_collective(trace: KinetoTrace, label: TraceEvent, kind: str, until: float, claimed: set[tuple]):
    """The c10d call in ``label`` and its gloo work: the first work of the kind's names on another thread that
    starts from the call's start to ``until`` (where the loop waits on it) and no earlier call claimed. The call
    only enqueues the work, so the work may start after the call returned ([Note: gloo's work after its call])."""
    ops = ALL_GATHER_OPS if kind == "all_gather" else REDUCE_SCATTER_OPS
    main = label.thread  # the c10d call runs on the label's thread, gloo's work on its own
    op = next((e for e in trace.cpu if e.thread == main and e.name in ops and label.contains(e.ts)), None)
    if op is None:
        return None
    names = GLOO_WORK[kind]
    work = [e for e in trace.cpu if e.name in names and e.thread != main and op.ts <= e.ts <= until
            and (e.ts, e.thread) not in claimed]
    first = min(work, key=lambda e: e.ts, default=None)
    if first is not None:
        claimed.add((first.ts, first.thread))
    span = (first.ts, first.end) if first is not None else (op.ts, op.end)
    # the thread's own work around the transfer, inside the label: the copy-in (and gloo's input copy) before, the
    # copy-out after (an async all-gather's transfer may start after its label ended)
    host_ms = (min(span[0], label.end) - label.ts + max(0.0, label.end - span[1])) / 1e3
    dims = op.input_dims[0 if kind == "all_gather" else 1] if len(op.input_dims) > 1 else None
    dtype_bytes = DTYPE_BYTES.get(op.input_types[0]) if op.input_types else None
    nbytes = _numel(dims) * dtype_bytes if dims and dtype_bytes else None
    call_copy_ms = max(0.0, min(span[0], op.end) - op.ts) / 1e3
    return span, nbytes, dtype_bytes, host_ms, call_copy_ms, (span[1] - span[0]) / 1e3


def _gpu_collective(trace: KinetoTrace, label: TraceEvent, kind: str):
    word = "AllGather" if kind == "all_gather" else "ReduceScatter"
    launched = trace.launched_in(label)
    nccl = [k for k in launched if "nccl" in k.name.lower() and word.lower() in k.name.lower()]
    if not nccl:
        return None
    span = (min(k.ts for k in launched), max(k.end for k in launched))  # the NCCL kernel and the copy-in
    k = nccl[0]
    dtype_bytes = DTYPE_BYTES.get(k.dtype) if k.dtype else None
    numel = (k.nelems[1] if kind == "all_gather" else k.nelems[0]) if k.nelems else None
    nbytes = numel * dtype_bytes if numel and dtype_bytes else None
    return span, nbytes, dtype_bytes, 0.0, 0.0, (k.end - k.ts) / 1e3


def _numel(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n
