"""What a parameter group does to the step's resources: unshard, wait for it, reshard, reduce-scatter.

Follows ``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``
(``FSDPParamGroup``) and ``_fsdp_collectives.py`` (``foreach_reduce``). The
arrays are :class:`~planner.simulation._kernel.state.StepState`'s and
:class:`~planner.simulation._kernel.state.Trace`'s, passed one by one ([Note: Arrays,
not bundles, in the hot path]).
"""

from __future__ import annotations

from planner.artifacts.knobs import position
from planner.simulation._kernel.state import (
    ALL_GATHER,
    ALL_GATHER_ROW,
    ALL_GATHER_STREAM,
    COMM_TOTAL,
    COMPUTE_STREAM,
    CPU,
    CPU_WAIT,
    EVENTS,
    HELD,
    HELD_HEAD,
    HELD_TAIL,
    IN_FLIGHT,
    LAST_COPY_OUT,
    LAST_REDUCE_SCATTER_END,
    PENDING,
    PROCESS_GROUP,
    REDUCE_SCATTER,
    REDUCE_SCATTER_GROUP,
    RS_HEAD,
    RS_TAIL,
    SHARDED,
    UNSHARD_STATE,
    UNSHARDED,
    UNSHARDED_ALIVE,
    UNSHARDED_PEAK,
    njit,
)
from planner.simulation._kernel.timeline import allocate, beside_all_gathers, event

MAX_INPUT_BUFFERS = position("reduce_scatter_max_input_buffers")  # planner.artifacts.knobs: PlanArrays.knobs[here]
SEPARATE_GROUP = position("separate_reduce_scatter_group")  # PlanArrays.knobs[here]

# [Note: Gloo's all-gather buffer]
# On a CPU device (gloo) an all-gather allocates, besides FSDP2's output,
# a second buffer of the output's size (seen in the profiler under
# ``FSDP::all_gather`` as two ``aten::empty`` of the unsharded bytes). A
# synchronous all-gather frees it before returning; with ``async_op=True``
# it stays alive while the all-gather is in flight, beside the compute,
# until ``wait_for_unshard``. On the reference Llama this put the measured
# peak of every async plan one block's unsharded bytes above FSDP2's
# default, which the model missed (python -m bench.peak_memory).

# [Note: Gloo's two worker threads]
# ``ProcessGroupGloo`` runs its collectives on a pool of worker threads (``Options::threads``, 2 by default), taken
# from one queue in issue order: a collective starts as soon as a worker is free, beside the one still running. On
# a CPU device a synchronous reduce-scatter issued while a prefetch all-gather is in flight (async unshard, in
# backward) therefore starts at once, unless two all-gathers are running, and then when the first ends. The two
# share the cores as compute and a collective do (``overlap_slowdown``): an all-gather and a reduce-scatter issued
# together both end later than either alone and sooner than the two in turn, slowed about as much as compute
# beside an all-gather (the measurements: docs/decisions/rule-evidence.md). A reduce-scatter group of its own
# (``set_separate_reduce_scatter_group``) is another pool: it never waits for the all-gathers, and shares the cores
# with them the same way. A model that queued the reduce-scatter behind the all-gather would make every async
# plan's backward pay for both in turn.

# [Note: record_stream holds all-gather outputs]
# On GPU with ``unshard_async_op=True``, c10d's all-gather calls
# ``record_stream`` on its output for the NCCL stream (seed:
# fsdp2-async-unshard-memory-overallocation, pytorch issue "FSDP2 memory
# over-allocation with _set_unshard_async_op(True) and explicit prefetch").
# When ``wait_for_unshard`` drops the output after the copy-out, the caching
# allocator counts it freed (``memory_allocated`` falls) but records an event
# on the NCCL stream and reuses the block only once that event has completed:
# once every collective the process group has queued by then (the explicit
# prefetches issued ahead) has ended. It checks the events when the CPU next
# allocates, so a CPU running ahead of the GPU holds the blocks longer. Held
# bytes add to what the allocator must reserve (``max_memory_reserved``),
# not to ``max_memory_allocated``: ``SimResult.reserved_peak_bytes``. Held
# blocks are released when the CPU next issues an all-gather or a copy-out,
# if their event has completed by then.


# [Note: World size 1]
# At world size 1 FSDP2 runs no collective (torch 2.13, ``FSDPParamGroup.unshard``: ``if world_size == 1``).
# ``unshard`` records an event and returns: a prefetch allocates nothing and takes no time. ``wait_for_unshard``
# then allocates the unsharded parameters and copies the sharded ones in, on the compute stream (CPU: the
# thread), with no all-gather output beside them; the recorder's all-gather time at world size 1 is that copy
# (``FSDPModule.unshard`` waits). ``unshard`` notes the copy's duration (ms) in ``all_gather_end``, which at world
# size 1 holds no all-gather's end, and the wait adds it. So a deeper prefetch holds no extra memory there, and
# keeping the last block unsharded holds one block more, where the model of larger worlds has a prefetch already
# holding it (checked on a GPU: docs/decisions/rule-evidence.md).


@njit(cache=True)
def release_held(clock, counters, held):
    """Release the held blocks whose event completed by the CPU's time.

    [Note: record_stream holds all-gather outputs].
    """
    while counters[HELD_HEAD] < counters[HELD_TAIL] and held[counters[HELD_HEAD], 0] <= clock[CPU]:
        counters[HELD] -= int(held[counters[HELD_HEAD], 1])
        counters[HELD_HEAD] += 1


@njit(cache=True)
def unshard(i, all_gather_ms, unsharded_bytes, cfg, clock, counters, module_state, all_gather_end, in_flight,
            events, samples, held):
    """``FSDPParamGroup.unshard`` of module ``i``: issue its all-gather.

    Callers skip modules already pending or unsharded, as
    ``FSDPParamGroup.unshard`` returns early for them. The all-gather starts
    when the issuing thread (GPU: and the all-gather streams) and the process
    group are free; its output is allocated at issue
    (``foreach_all_gather``). On a CPU device without ``async_op`` the thread
    blocks until it ends.
    """
    if cfg.single_rank:  # [Note: World size 1]: nothing until wait_for_unshard
        counters[UNSHARDED_ALIVE] += unsharded_bytes[i]
        if counters[UNSHARDED_ALIVE] > counters[UNSHARDED_PEAK]:
            counters[UNSHARDED_PEAK] = counters[UNSHARDED_ALIVE]
        module_state[i, UNSHARD_STATE] = PENDING
        all_gather_end[i] = all_gather_ms[i] * cfg.comm_scale  # the copy's duration, for the wait
        return
    issue = clock[CPU]
    if cfg.gpu:
        release_held(clock, counters, held)
        if clock[ALL_GATHER_STREAM] > issue:
            issue = clock[ALL_GATHER_STREAM]
    start = issue if issue > clock[PROCESS_GROUP] else clock[PROCESS_GROUP]
    # Evaluated as written (not through a shared subtotal), so rounding matches the reference timelines.
    end = start + all_gather_ms[i] * cfg.comm_scale + cfg.collective_latency_ms
    clock[PROCESS_GROUP] = end
    clock[COMM_TOTAL] += all_gather_ms[i] * cfg.comm_scale + cfg.collective_latency_ms
    allocate(clock, counters, samples, unsharded_bytes[i])
    counters[UNSHARDED_ALIVE] += unsharded_bytes[i]
    if counters[UNSHARDED_ALIVE] > counters[UNSHARDED_PEAK]:
        counters[UNSHARDED_PEAK] = counters[UNSHARDED_ALIVE]
    if cfg.track_in_flight:
        module_state[i, ALL_GATHER_ROW] = counters[EVENTS] if events.shape[0] > 1 else -1
        in_flight[counters[IN_FLIGHT]] = i
        counters[IN_FLIGHT] += 1
    event(events, counters, ALL_GATHER, i, start, end)
    if not cfg.gpu:
        allocate(clock, counters, samples, unsharded_bytes[i])  # [Note: Gloo's all-gather buffer]
    if not cfg.gpu and not cfg.unshard_async_op:  # [Note: CPU device] a sync collective blocks the thread
        clock[CPU] = end
        allocate(clock, counters, samples, -unsharded_bytes[i])
    module_state[i, UNSHARD_STATE] = PENDING
    all_gather_end[i] = end


@njit(cache=True)
def wait_for_unshard(i, forward, unsharded_bytes, cfg, clock, counters, module_state, all_gather_end, in_flight,
                     events, samples, held):
    """``FSDPParamGroup.wait_for_unshard`` of module ``i`` (callers check its all-gather is pending).

    GPU: the compute stream waits for the all-gather; in forward without
    ``async_op`` this is the copy-out that lets the next implicit prefetch
    start; with ``async_op`` the output's block is held from reuse
    ([Note: record_stream holds all-gather outputs]). CPU: the thread waits.
    World size 1: the copy of [Note: World size 1].
    """
    if cfg.single_rank:
        copy = all_gather_end[i]  # noted by unshard
        if cfg.gpu:
            clock[COMPUTE_STREAM] = (clock[COMPUTE_STREAM] if clock[COMPUTE_STREAM] > clock[CPU] else clock[CPU]) + copy
        else:
            clock[CPU] += copy
        allocate(clock, counters, samples, unsharded_bytes[i])
        module_state[i, UNSHARD_STATE] = UNSHARDED
        return
    for q in range(counters[IN_FLIGHT]):
        if in_flight[q] == i:
            for r in range(q, counters[IN_FLIGHT] - 1):
                in_flight[r] = in_flight[r + 1]
            counters[IN_FLIGHT] -= 1
            break
    end = all_gather_end[i]
    if cfg.gpu:
        if end > clock[COMPUTE_STREAM]:
            clock[COMPUTE_STREAM] = end
        if forward and not cfg.unshard_async_op:
            # Implicit prefetch keeps two all-gather outputs alive: the
            # all-gather streams wait for the previous copy-out before the next
            # all-gather ([Note: Overlapping all-gather copy-in and all-gather]).
            if clock[LAST_COPY_OUT] >= 0 and clock[LAST_COPY_OUT] > clock[ALL_GATHER_STREAM]:
                clock[ALL_GATHER_STREAM] = clock[LAST_COPY_OUT]
            clock[LAST_COPY_OUT] = clock[COMPUTE_STREAM] if clock[COMPUTE_STREAM] > clock[CPU] else clock[CPU]
    else:
        if end > clock[CPU]:
            event(events, counters, CPU_WAIT, i, clock[CPU], end)
            clock[CPU] = end
        if cfg.unshard_async_op:  # [Note: Gloo's all-gather buffer] released with the waited work
            allocate(clock, counters, samples, -unsharded_bytes[i])
    # foreach_all_gather_copy_out: the unsharded parameters are allocated and filled from the all-gather
    # output, which is freed after the copy: for a moment both are alive.
    if cfg.gpu:
        release_held(clock, counters, held)
    allocate(clock, counters, samples, unsharded_bytes[i])
    if cfg.gpu and cfg.unshard_async_op and clock[PROCESS_GROUP] > clock[CPU]:
        tail = counters[HELD_TAIL]  # reusable once the collectives queued so far have ended
        held[tail, 0] = clock[PROCESS_GROUP]
        held[tail, 1] = unsharded_bytes[i]
        counters[HELD_TAIL] = tail + 1
        counters[HELD] += unsharded_bytes[i]
    allocate(clock, counters, samples, -unsharded_bytes[i])
    module_state[i, UNSHARD_STATE] = UNSHARDED


@njit(cache=True)
def reshard(i, unsharded_bytes, cfg, clock, counters, module_state, all_gather_end, in_flight, events, samples, held):
    """``FSDPParamGroup.reshard`` of module ``i`` (callers check it is not sharded): free its unsharded parameters.

    A prefetch still pending is waited on first.
    """
    if module_state[i, UNSHARD_STATE] == PENDING:
        wait_for_unshard(i, False, unsharded_bytes, cfg, clock, counters, module_state, all_gather_end, in_flight,
                         events, samples, held)
    allocate(clock, counters, samples, -unsharded_bytes[i])
    counters[UNSHARDED_ALIVE] -= unsharded_bytes[i]
    module_state[i, UNSHARD_STATE] = SHARDED


@njit(cache=True, inline="always")  # takes the profile's bundle: inlined, it costs no reference counting
def reduce_scatter(i, prof, cfg, clock, counters, queue_end, queue_bytes, events, samples, in_flight, all_gather_end,
                   module_state):
    """``foreach_reduce`` of module ``i``'s gradient, issued by ``FSDPParamGroup.post_backward``.

    Its input buffer, a copy of the unsharded gradient (freed once copied
    in: for that moment both are alive), is kept in
    ``comm_ctx.reduce_scatter_states`` until a later module's post-backward
    finds ``reduce_scatter_max_input_buffers`` there and drops the oldest,
    or the final callback clears them (``queue_end``/``queue_bytes`` from
    ``counters[RS_HEAD]`` to ``counters[RS_TAIL]``). This holds on CPU too:
    the code is the same, so a synchronous reduce-scatter's buffer outlives
    it (the profiler shows it alive at the next pre-backward's peak). GPU:
    dropping the oldest first makes the compute stream wait for it. CPU:
    synchronous ([Note: CPU device]). GPU: it queues behind the collectives of
    its process group, the all-gathers' too, unless
    ``set_separate_reduce_scatter_group`` gave it its own. CPU: it runs beside
    the all-gathers in flight ([Note: Gloo's two worker threads]).
    """
    # reduce_scatter_max_input_buffers: before foreach_reduce, the oldest input buffers are dropped (GPU: the
    # compute stream waits on their reduce-scatters first; FSDPParamGroup.post_backward).
    while counters[RS_TAIL] - counters[RS_HEAD] >= cfg.knobs[MAX_INPUT_BUFFERS]:
        head = counters[RS_HEAD]
        if cfg.gpu and queue_end[head] > clock[COMPUTE_STREAM]:
            clock[COMPUTE_STREAM] = queue_end[head]
        allocate(clock, counters, samples, -queue_bytes[head])
        counters[RS_HEAD] = head + 1
    if cfg.gpu:
        issue = clock[COMPUTE_STREAM] if clock[COMPUTE_STREAM] > clock[CPU] else clock[CPU]
    else:
        issue = clock[CPU]
    # foreach_reduce copies the unsharded gradient into a new input buffer (at reduce_dtype: under a mixed-precision
    # policy bf16 gradients go in as fp32), then drops the gradient: for a moment both are alive.
    allocate(clock, counters, samples, prof.reduce_scatter_bytes[i])
    allocate(clock, counters, samples, -prof.grad_bytes[i])
    separate = cfg.knobs[SEPARATE_GROUP] != 0
    group = REDUCE_SCATTER_GROUP if separate else PROCESS_GROUP
    if cfg.gpu:
        start = issue if issue > clock[group] else clock[group]
        end = start + prof.reduce_scatter_ms[i] * cfg.comm_scale + cfg.collective_latency_ms
        clock[group] = end
    else:  # [Note: Gloo's two worker threads]
        start = issue
        if not separate:  # both workers busy: wait for the first all-gather to end
            running, first_end = 0, 0.0
            for q in range(counters[IN_FLIGHT]):
                e = all_gather_end[in_flight[q]]
                if e > issue:
                    running += 1
                    if running == 1 or e < first_end:
                        first_end = e
            if running >= 2:
                start = first_end
        end = beside_all_gathers(start, start + prof.reduce_scatter_ms[i] * cfg.comm_scale + cfg.collective_latency_ms,
                                 cfg, clock, counters, in_flight, all_gather_end, module_state, events)
        clock[REDUCE_SCATTER_GROUP] = end
    clock[COMM_TOTAL] += prof.reduce_scatter_ms[i] * cfg.comm_scale + cfg.collective_latency_ms
    event(events, counters, REDUCE_SCATTER, i, start, end)
    tail = counters[RS_TAIL]
    queue_end[tail] = end
    queue_bytes[tail] = prof.reduce_scatter_bytes[i]
    counters[RS_TAIL] = tail + 1
    if not cfg.gpu:
        clock[CPU] = end  # [Note: CPU device] the reduce-scatter is synchronous
    clock[LAST_REDUCE_SCATTER_END] = end
