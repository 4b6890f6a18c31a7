"""The kernel's data: input bundles, the state of a step, and the named slots of its arrays.

Inputs come in three bundles: :class:`ProfileArrays` (per profile),
:class:`PlanArrays` (per plan) and :class:`KernelParams` (the calibrated
``planner.simulation.simulator.SimParams``). A step's state is :class:`StepState`: its
clocks, its byte and event counters, each module's state (FSDP2's
``FSDPParamGroup``: unsharded or not, its all-gather), the all-gathers in
flight (``AllGatherState``) and the reduce-scatters in flight
(``ReduceScatterState``); :class:`Trace` holds the timeline. The slots of
the clock, counter and module-state arrays are named by the module-level
constants below, which numba folds.

[Note: Arrays, not bundles, in the hot path]
Taking an array out of a NamedTuple in compiled code costs a reference-count
increment and decrement; passing it as an argument costs nothing, and the
step's time is mostly such overhead when bundles are passed around
(``python -m bench.simulator_speed`` measures it). So the hooks (:mod:`planner.simulation._kernel.hooks`)
unpack the bundles once per microbatch, and the per-module functions they
call take plain arrays; :class:`StepConfig` holds only scalars, which cost
nothing to read.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from planner.artifacts.knobs import position

try:  # compiled where numba is installed (a dependency); plain Python otherwise, same results
    from numba import njit, types
    from numba.extending import overload
except ImportError:  # pragma: no cover
    overload = types = None

    def njit(*args, **kwargs):
        if args and callable(args[0]):
            return args[0]
        return lambda f: f

UNSHARD_ASYNC_OP = position("unshard_async_op")  # planner.artifacts.knobs: PlanArrays.knobs[UNSHARD_ASYNC_OP]
POST_OPTIM_EVENT = position("post_optim_event")  # PlanArrays.knobs[here]

# StepState.clock slots, ms.
CPU = 0  # the thread that runs the hooks (and, on a CPU device, the compute)
COMPUTE_STREAM = 1  # GPU: the compute stream is free from here
PROCESS_GROUP = 2  # the process group runs collectives one after another: free from here
ALL_GATHER_STREAM = 3  # GPU: the all-gather streams may start from here
LAST_COPY_OUT = 4  # GPU implicit prefetch: when the previous all-gather output was consumed (-1: none)
COMPUTE_TOTAL = 5  # compute issued so far
COMM_TOTAL = 6  # communication issued so far
LAST_REDUCE_SCATTER_END = 7  # when the last reduce-scatter issued ends
REDUCE_SCATTER_GROUP = 8  # set_separate_reduce_scatter_group: reduce-scatter's own process group is free from here
CLOCKS = 9

# StepState.counters slots.
ALIVE = 0  # bytes alive beyond the sharded state and optimizer state
PEAK = 1  # their peak
UNSHARDED_ALIVE = 2  # all-gather output bytes, from issue to reshard
UNSHARDED_PEAK = 3
EVENTS = 4  # trace events written
SAMPLES = 5  # memory samples written
IN_FLIGHT = 6  # length of StepState.in_flight
RS_HEAD = 7  # GPU: the oldest reduce-scatter in flight (index into the reduce-scatter queue)
RS_TAIL = 8  # GPU: one past the newest
HELD = 9  # GPU: bytes freed but held from reuse by record_stream ([Note: record_stream holds all-gather outputs])
HELD_HEAD = 10  # the oldest held block (index into StepState.held)
HELD_TAIL = 11  # one past the newest
RESERVED_PEAK = 12  # peak of ALIVE + HELD: what the caching allocator must reserve
COUNTERS = 13

# StepState.module_state columns, per module.
UNSHARD_STATE = 0  # SHARDED, PENDING (all-gather issued, not waited on) or UNSHARDED
ALL_GATHER_ROW = 1  # the trace row of the module's last all-gather (-1: none)
GRAD_ALIVE = 2  # 1 while its unsharded gradient is allocated (the root: 1 its part before its children, 2 all)
SHARDED_GRAD_ALIVE = 3  # 1 once its sharded gradient exists (the reduce-scatter's output, kept to the optimizer)
MODULE_FIELDS = 4
SHARDED, PENDING, UNSHARDED = 0, 1, 2

# Trace event kinds (planner.simulation.simulator names them).
FORWARD, BACKWARD, OPTIMIZER, ALL_GATHER, REDUCE_SCATTER, CPU_WAIT = 0, 1, 2, 3, 4, 5


class ProfileArrays(NamedTuple):
    """A profile's figures by module index (position in ``Fingerprint.module_fqns``); times ms, sizes bytes."""

    all_gather_ms: np.ndarray  # float64[n]
    reduce_scatter_ms: np.ndarray  # float64[n]
    forward_ms: np.ndarray  # float64[n], per call
    backward_ms: np.ndarray  # float64[n], per call
    unsharded_bytes: np.ndarray  # int64[n]
    grad_bytes: np.ndarray  # int64[n], per call
    reduce_scatter_bytes: np.ndarray  # int64[n]: the reduce-scatter's input buffer, the gradient at reduce_dtype
    activation_bytes: np.ndarray  # int64[n], per call
    recompute_bytes: np.ndarray  # int64[n], per call: a checkpointed block's recomputed activations, in its backward
    backward_temp_bytes: np.ndarray  # int64[n]: its backward's temporaries (the root's: before its children's)
    sharded_bytes: np.ndarray  # int64[n]: this rank's parameter shard, and so its sharded gradient
    children: np.ndarray  # int64: the modules other than the root, in pre-forward order
    post_forward: np.ndarray  # int64: the post-forward order, with multiplicity
    root: int
    root_post_index: int  # the root's last position in post_forward
    root_forward_pre_ms: float  # the root's forward before its first child's
    root_forward_post_ms: float
    root_backward_pre_ms: float  # the root's backward before its first child's
    root_backward_post_ms: float
    root_activation_pre_bytes: int  # activations the root saves before its first child (freed at the end of its
    # backward; the rest, at the end of its part before its children's)
    root_post_grad_bytes: int  # of the root's gradient, what comes after its children's backward (the embedding's)
    gpu: bool
    single_rank: bool  # world size 1: FSDP2 runs no collective ([Note: World size 1] in param_group.py)
    microbatches: int
    optimizer_ms: float
    optimizer_temp_bytes: int  # what optimizer.step() allocates above its start, at its peak
    post_optimizer_ms: float  # GPU: the loop's stream work after the previous optimizer step ([Note: Post-optimizer
    # event] in planner.simulation.simulator)


class PlanArrays(NamedTuple):
    """A plan by module index: prefetch lists as CSR (offsets ``int64[n + 1]``, targets ``int64``) and the knobs."""

    forward_prefetch_offsets: np.ndarray
    forward_prefetch_targets: np.ndarray
    backward_prefetch_offsets: np.ndarray
    backward_prefetch_targets: np.ndarray
    reshard_after_forward: np.ndarray  # bool[n]
    knobs: tuple  # int, one per PLAN_KNOBS: the plan knobs, read by position (planner.artifacts.knobs.position); a
    # tuple, not an array, so StepConfig can hold it as scalars
    module_knobs: np.ndarray  # int64[n, len(MODULE_KNOBS)]: each module's knobs, alike


class KernelParams(NamedTuple):
    """``planner.simulation.simulator.SimParams`` as the kernel uses them."""

    issue_overhead_ms: float
    overlap_excess: float  # overlap_slowdown - 1: the extra time per ms of overlap
    comm_scale: float
    collective_latency_ms: float
    compute_scale: float


class StepConfig(NamedTuple):
    """The scalars every per-module function reads (free to read: [Note: Arrays, not bundles, in the hot path])."""

    gpu: bool
    single_rank: bool
    unshard_async_op: bool
    # Keep the all-gathers in flight in issue order: only where they run beside other work (CPU, async).
    track_in_flight: bool
    knobs: tuple  # PlanArrays.knobs
    issue_overhead_ms: float
    overlap_excess: float
    comm_scale: float
    collective_latency_ms: float


class StepState(NamedTuple):
    """The state of one simulated step."""

    clock: np.ndarray  # float64[CLOCKS], ms
    counters: np.ndarray  # int64[COUNTERS]
    module_state: np.ndarray  # int64[n, MODULE_FIELDS]
    all_gather_end: np.ndarray  # float64[n]: when each module's last all-gather ends, ms
    in_flight: np.ndarray  # int64[n]: modules whose all-gather is in flight, in issue order (counters[IN_FLIGHT])
    reduce_scatter_end: np.ndarray  # float64: GPU reduce-scatter queue, oldest first (RS_HEAD..RS_TAIL), ms
    reduce_scatter_bytes: np.ndarray  # int64: the input buffer each holds
    held: np.ndarray  # float64[slots, 2]: GPU blocks held by record_stream, oldest first: (reusable from ms, bytes)


class Trace(NamedTuple):
    """The timeline, when traced (arrays of one row otherwise)."""

    events: np.ndarray  # float64[rows, 4]: kind, module, start ms, end ms
    samples: np.ndarray  # float64[rows, 2]: ms, bytes alive


@njit(cache=True)
def new_step(prof, plan, params):
    """The :class:`StepConfig` and a fresh :class:`StepState` for one step of ``prof`` under ``plan``."""
    n = prof.all_gather_ms.shape[0]
    unshard_async_op = plan.knobs[UNSHARD_ASYNC_OP] != 0
    cfg = StepConfig(prof.gpu, prof.single_rank, unshard_async_op, (not prof.gpu) and unshard_async_op, plan.knobs,
                     params.issue_overhead_ms, params.overlap_excess,
                     params.comm_scale, params.collective_latency_ms)
    clock = np.zeros(CLOCKS)
    clock[LAST_COPY_OUT] = -1.0
    if prof.gpu and prof.post_optimizer_ms > 0:  # [Note: Post-optimizer event]
        post_optimizer = prof.post_optimizer_ms * params.compute_scale
        clock[COMPUTE_STREAM] = post_optimizer  # the previous step's tail, queued by a CPU that ran ahead
        clock[COMPUTE_TOTAL] = post_optimizer
        if plan.knobs[POST_OPTIM_EVENT] == 0:  # FSDPState._root_pre_forward: wait_stream(current_stream)
            clock[ALL_GATHER_STREAM] = post_optimizer
    module_state = np.zeros((n, MODULE_FIELDS), np.int64)
    module_state[:, ALL_GATHER_ROW] = -1
    slots = prof.post_forward.shape[0] * prof.microbatches + 1  # one reduce-scatter per module call, at most
    # One held block per wait for an async all-gather: at most one per all-gather issued, which is each hook's own
    # (pre-forward, pre-backward) and its prefetch list's, per module call and microbatch.
    longest = 0
    for offsets in (plan.forward_prefetch_offsets, plan.backward_prefetch_offsets):
        for m in range(n):
            if offsets[m + 1] - offsets[m] > longest:
                longest = offsets[m + 1] - offsets[m]
    held_slots = 2 * prof.post_forward.shape[0] * prof.microbatches * (1 + longest) + 1
    st = StepState(clock, np.zeros(COUNTERS, np.int64), module_state, np.zeros(n), np.zeros(n, np.int64),
                   np.zeros(slots), np.zeros(slots, np.int64), np.zeros((held_slots, 2)))
    return cfg, st
