"""One FSDP2 step: the hooks ``FSDPState`` runs, in program order, over every microbatch.

Follows ``torch/distributed/fsdp/_fully_shard/_fsdp_state.py`` (the pre/post
forward and backward hooks and the final callback); the rules and their
sources are described in :mod:`planner.simulation.simulator`. Each phase unpacks the
bundles once ([Note: Arrays, not bundles, in the hot path] in
:mod:`planner.simulation._kernel.state`).

[Note: Plain tuples at the boundary]
numba types a NamedTuple argument on a slow path (7 µs a call for two
19-field bundles, against 3 µs for the same fields as plain tuples), so
:func:`step` takes each bundle's fields as a plain tuple and rebuilds the
NamedTuple inside compiled code, where it costs nothing.
"""

from __future__ import annotations

from planner.artifacts.knobs import position
from planner.simulation._kernel.param_group import reduce_scatter, reshard, unshard, wait_for_unshard
from planner.simulation._kernel.state import (
    BACKWARD,
    COMM_TOTAL,
    COMPUTE_STREAM,
    COMPUTE_TOTAL,
    CPU,
    EVENTS,
    FORWARD,
    GRAD_ALIVE,
    LAST_REDUCE_SCATTER_END,
    OPTIMIZER,
    PEAK,
    PENDING,
    RESERVED_PEAK,
    RS_HEAD,
    RS_TAIL,
    SAMPLES,
    SHARDED,
    SHARDED_GRAD_ALIVE,
    UNSHARD_STATE,
    UNSHARDED_PEAK,
    KernelParams,
    PlanArrays,
    ProfileArrays,
    Trace,
    new_step,
    njit,
)
from planner.simulation._kernel.timeline import allocate, compute

UNSHARD_IN_BACKWARD = position("unshard_in_backward")  # planner.artifacts.knobs: PlanArrays.module_knobs[:, here]
RESHARD_AFTER_BACKWARD = position("reshard_after_backward")  # PlanArrays.knobs[here]
COMM_POOL = position("allocate_memory_from_process_group_for_comm")  # PlanArrays.knobs[here]


@njit(cache=True)
def _forward(prof, plan, cfg, st, trace, compute_scale):
    """One microbatch's forward: root pre-forward, the root's own head (embedding), each child, the root's tail.

    Per module: ``FSDPState._pre_forward`` -> ``FSDPParamGroup.pre_forward``
    (unshard, wait), the explicit forward prefetch
    (``FSDPParamGroup._prefetch_unshard``), the forward compute, then
    ``FSDPParamGroup.post_forward`` (reshard if ``reshard_after_forward``).
    """
    clock, counters, module_state = st.clock, st.counters, st.module_state
    ag_end, in_flight, events, samples, held = st.all_gather_end, st.in_flight, trace.events, trace.samples, st.held
    ag_ms, unsharded, activation = prof.all_gather_ms, prof.unsharded_bytes, prof.activation_bytes
    offsets, targets = plan.forward_prefetch_offsets, plan.forward_prefetch_targets
    resharding = plan.reshard_after_forward
    root = prof.root
    for j in range(-1, prof.children.shape[0]):
        i = root if j < 0 else prof.children[j]
        clock[CPU] += cfg.issue_overhead_ms
        if module_state[i, UNSHARD_STATE] == SHARDED:
            unshard(i, ag_ms, unsharded, cfg, clock, counters, module_state, ag_end, in_flight, events, samples, held)
        if module_state[i, UNSHARD_STATE] == PENDING:
            wait_for_unshard(
                i, True, unsharded, cfg, clock, counters, module_state, ag_end, in_flight, events, samples, held
            )
        for p in range(offsets[i], offsets[i + 1]):
            t = targets[p]
            if module_state[t, UNSHARD_STATE] == SHARDED:
                unshard(
                    t, ag_ms, unsharded, cfg, clock, counters, module_state, ag_end, in_flight, events, samples, held
                )
        if j < 0:
            if prof.root_forward_pre_ms > 0:
                compute(i, FORWARD, prof.root_forward_pre_ms * compute_scale, cfg, clock, counters, in_flight, ag_end,
                        module_state, events)
            allocate(clock, counters, samples, prof.root_activation_pre_bytes)
            continue
        compute(i, FORWARD, prof.forward_ms[i] * compute_scale, cfg, clock, counters, in_flight, ag_end,
                module_state, events)
        allocate(clock, counters, samples, activation[i])  # saved for backward
        clock[CPU] += cfg.issue_overhead_ms
        if resharding[i] and module_state[i, UNSHARD_STATE] != SHARDED:
            reshard(i, unsharded, cfg, clock, counters, module_state, ag_end, in_flight, events, samples, held)
    if prof.root_forward_post_ms > 0:
        compute(root, FORWARD, prof.root_forward_post_ms * compute_scale, cfg, clock, counters, in_flight, ag_end,
                module_state, events)
    allocate(clock, counters, samples, activation[root] - prof.root_activation_pre_bytes)
    clock[CPU] += cfg.issue_overhead_ms
    if resharding[root] and module_state[root, UNSHARD_STATE] != SHARDED:
        reshard(root, unsharded, cfg, clock, counters, module_state, ag_end, in_flight, events, samples, held)


@njit(cache=True, inline="always")  # per module: no call, no bundle copies
def _pre_backward(i, post_index, prof, plan, cfg, st, trace):
    """``FSDPState._pre_backward`` -> ``FSDPParamGroup.pre_backward`` (unshard, wait), then the explicit backward
    list, else ``FSDPParamGroup._backward_prefetch`` (the previous module in post-forward order). A module set
    ``set_unshard_in_backward(False)`` is never all-gathered in backward (``FSDPParamGroup.unshard`` returns early
    in pre-backward, for its own unshard and for a prefetch of it)."""
    clock, counters, module_state = st.clock, st.counters, st.module_state
    ag_end, in_flight, events, samples, held = st.all_gather_end, st.in_flight, trace.events, trace.samples, st.held
    ag_ms, unsharded, own = prof.all_gather_ms, prof.unsharded_bytes, plan.module_knobs
    clock[CPU] += cfg.issue_overhead_ms
    if module_state[i, UNSHARD_STATE] == SHARDED and own[i, UNSHARD_IN_BACKWARD]:
        unshard(i, ag_ms, unsharded, cfg, clock, counters, module_state, ag_end, in_flight, events, samples, held)
    if module_state[i, UNSHARD_STATE] == PENDING:
        wait_for_unshard(
            i, False, unsharded, cfg, clock, counters, module_state, ag_end, in_flight, events, samples, held
        )
    first, last = plan.backward_prefetch_offsets[i], plan.backward_prefetch_offsets[i + 1]
    for p in range(first, last):
        t = plan.backward_prefetch_targets[p]
        if module_state[t, UNSHARD_STATE] == SHARDED and own[t, UNSHARD_IN_BACKWARD]:
            unshard(t, ag_ms, unsharded, cfg, clock, counters, module_state, ag_end, in_flight, events, samples, held)
    if last == first and post_index > 0:
        t = prof.post_forward[post_index - 1]
        if module_state[t, UNSHARD_STATE] == SHARDED and own[t, UNSHARD_IN_BACKWARD]:
            unshard(t, ag_ms, unsharded, cfg, clock, counters, module_state, ag_end, in_flight, events, samples, held)


@njit(cache=True, inline="always")
def _backward(i, ms, temp, reduce, reshard_after, prof, cfg, st, trace):
    """Module ``i``'s backward compute, then ``FSDPParamGroup.post_backward``: reshard, then reduce-scatter
    (only with gradient sync, ``set_requires_gradient_sync``).

    ``temp``: the compute's temporaries (``ModuleProfile.backward_temp_bytes``), allocated for the compute and freed
    after it, on top of its gradient and recomputed activations ([Note: Backward temporaries] in
    :mod:`runtime.recording.compute_timer`).

    A checkpointed module (``recompute_bytes`` > 0) recomputes its forward inside this compute, its parameters
    already unsharded by ``_pre_backward``: non-reentrant ``torch.utils.checkpoint`` re-runs the block when
    backward first unpacks one of its saved tensors (``_checkpoint_hook``'s unpack hook), and the recomputed
    tensors live until the block's gradient compute has used them. ``backward_ms`` holds the recompute; the
    recomputed activations are allocated for the compute and freed after it, on top of the checkpointed inputs
    (``activation_bytes``) kept since forward."""
    clock, counters, module_state = st.clock, st.counters, st.module_state
    ag_end, in_flight, events, samples, held = st.all_gather_end, st.in_flight, trace.events, trace.samples, st.held
    if not module_state[i, GRAD_ALIVE]:  # autograd allocates the unsharded gradient once
        module_state[i, GRAD_ALIVE] = 1
        allocate(clock, counters, samples, prof.grad_bytes[i])
    if prof.recompute_bytes[i] + temp:
        allocate(clock, counters, samples, prof.recompute_bytes[i] + temp)
    compute(i, BACKWARD, ms, cfg, clock, counters, in_flight, ag_end, module_state, events)
    # the root's: those of its forward before its children's (the rest went in its part before theirs)
    saved = prof.root_activation_pre_bytes if i == prof.root else prof.activation_bytes[i]
    allocate(clock, counters, samples, -saved - prof.recompute_bytes[i] - temp)
    clock[CPU] += cfg.issue_overhead_ms
    if reshard_after and module_state[i, UNSHARD_STATE] != SHARDED:
        reshard(i, prof.unsharded_bytes, cfg, clock, counters, module_state, ag_end, in_flight, events, samples, held)
    if reduce:
        reduce_scatter(i, prof, cfg, clock, counters, st.reduce_scatter_end, st.reduce_scatter_bytes, events, samples,
                       in_flight, ag_end, module_state)
        module_state[i, GRAD_ALIVE] = 0
        if not module_state[i, SHARDED_GRAD_ALIVE]:  # foreach_reduce: the sharded gradient, kept to the optimizer
            module_state[i, SHARDED_GRAD_ALIVE] = 1
            allocate(clock, counters, samples, prof.sharded_bytes[i])


@njit(cache=True)
def _microbatch_backward(last, prof, plan, cfg, st, trace, compute_scale):
    """One microbatch's backward, in reverse post-forward order.

    The root's pre-backward fires first (its output's gradient), its
    post-backward last (final callback). Without gradient sync (all but the
    ``last`` microbatch), ``set_reshard_after_backward`` decides whether
    modules reshard.
    """
    reshard_after = last or plan.knobs[RESHARD_AFTER_BACKWARD] != 0
    post, root = prof.post_forward, prof.root
    _pre_backward(root, prof.root_post_index, prof, plan, cfg, st, trace)
    if not st.module_state[root, GRAD_ALIVE]:  # the root's head (LM head) gets its gradients first
        st.module_state[root, GRAD_ALIVE] = 1
        allocate(st.clock, st.counters, trace.samples, prof.grad_bytes[root] - prof.root_post_grad_bytes)
    temp = prof.backward_temp_bytes[root]  # the loss's and the LM head's temporaries
    if temp:
        allocate(st.clock, st.counters, trace.samples, temp)
    if prof.root_backward_pre_ms > 0:
        compute(root, BACKWARD, prof.root_backward_pre_ms * compute_scale, cfg, st.clock, st.counters, st.in_flight,
                st.all_gather_end, st.module_state, trace.events)
    if temp:
        allocate(st.clock, st.counters, trace.samples, -temp)
    # the saved tensors of the root's forward after its children's (the final norm's, the LM head's, the loss's)
    # are used by this part of its backward, and autograd frees them as each node runs; the rest at its post part
    allocate(st.clock, st.counters, trace.samples, -(prof.activation_bytes[root] - prof.root_activation_pre_bytes))
    for index in range(post.shape[0] - 1, -1, -1):
        i = post[index]
        if i == root:
            continue
        _pre_backward(i, index, prof, plan, cfg, st, trace)
        _backward(i, prof.backward_ms[i] * compute_scale, prof.backward_temp_bytes[i], last, reshard_after, prof, cfg,
                  st, trace)
    if st.module_state[root, GRAD_ALIVE] == 1 and prof.root_post_grad_bytes:  # the rest (the embedding's), after
        st.module_state[root, GRAD_ALIVE] = 2                                  # its children's backward
        allocate(st.clock, st.counters, trace.samples, prof.root_post_grad_bytes)
    _backward(root, prof.root_backward_post_ms * compute_scale, 0, last, reshard_after, prof, cfg, st, trace)


@njit(cache=True)
def step(profile_fields, plan_fields, param_fields, events, samples):
    """Simulate one step (all microbatches, then the optimizer).

    Args:
        profile_fields, plan_fields, param_fields: the fields of a
            :class:`ProfileArrays`, :class:`PlanArrays` and
            :class:`KernelParams` as plain tuples ([Note: Plain tuples at the
            boundary]).
        events: ``float64[rows, 4]`` filled with the timeline, or one row: no trace.
        samples: ``float64[rows, 2]`` filled with ``(ms, bytes alive)``, or one row.

    Returns:
        ``(cpu_ms, compute_stream_ms, compute_ms, comm_ms, peak_bytes,
        peak_unsharded_bytes, reserved_peak_bytes, events_written,
        samples_written)``; the step
        ends at the later of the first two.
    """
    prof = ProfileArrays(*profile_fields)
    plan = PlanArrays(*plan_fields)
    params = KernelParams(*param_fields)
    trace = Trace(events, samples)
    cfg, st = new_step(prof, plan, params)
    for mb in range(prof.microbatches):
        _forward(prof, plan, cfg, st, trace, params.compute_scale)
        _microbatch_backward(mb == prof.microbatches - 1, prof, plan, cfg, st, trace, params.compute_scale)
    # FSDPState._root_post_backward_final_callback: wait for every reduce-scatter.
    clock, counters = st.clock, st.counters
    if prof.gpu:
        if clock[LAST_REDUCE_SCATTER_END] > clock[COMPUTE_STREAM]:
            clock[COMPUTE_STREAM] = clock[LAST_REDUCE_SCATTER_END]
    elif clock[LAST_REDUCE_SCATTER_END] > clock[CPU]:
        clock[CPU] = clock[LAST_REDUCE_SCATTER_END]
    for q in range(counters[RS_HEAD], counters[RS_TAIL]):  # reduce_scatter_states.clear(): the input buffers go
        allocate(clock, counters, samples, -st.reduce_scatter_bytes[q])
    allocate(clock, counters, samples, prof.optimizer_temp_bytes)  # e.g. Adam's foreach temporaries
    if prof.optimizer_ms > 0:
        compute(prof.root, OPTIMIZER, prof.optimizer_ms * params.compute_scale, cfg, clock, counters, st.in_flight,
                st.all_gather_end, st.module_state, events)
    allocate(clock, counters, samples, -prof.optimizer_temp_bytes)
    reserved = counters[RESERVED_PEAK]
    if prof.gpu and not prof.single_rank and plan.knobs[COMM_POOL] != 0:
        reserved += 2 * prof.unsharded_bytes.max()  # [Note: The process group's allocator]
    return (clock[CPU], clock[COMPUTE_STREAM], clock[COMPUTE_TOTAL], clock[COMM_TOTAL], counters[PEAK],
            counters[UNSHARDED_PEAK], reserved, counters[EVENTS], counters[SAMPLES])


# [Note: The process group's allocator]
# ``set_allocate_memory_from_process_group_for_comm(True)`` (``FSDPParamGroup.set_allocate_memory_from_process_group``)
# swaps FSDP2's all-gather and reduce-scatter for ``ProcessGroupAllocAllGather`` and ``ProcessGroupAllocReduceScatter``
# (``_fsdp_collectives.py``): their staging buffers come from ``backend.allocate_tensor`` where the backend supports
# it (NCCL: ``ncclMemAlloc`` memory registered for zero-copy over NVLink SHARP and IB SHARP), else ``torch.empty``
# (gloo: the same step, so no CPU rule). On GPU those buffers live in the process group's own memory pool, which
# the caching allocator's compute blocks do not share (pytorch #146589): the pool keeps at least the largest
# all-gather output and the largest reduce-scatter input reserved beside everything else, so the reserved peak grows
# by both (a lower bound: more buffers in flight at once reserve more). The zero-copy gain needs SHARP hardware a
# profile does not show, so the rule predicts no time change: the race measures it.
