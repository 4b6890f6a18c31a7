"""Discrete-event simulator of one FSDP2 training step.

``simulate(profile, plan)`` walks the CPU thread through the hooks FSDP2 runs in
one step, in program order, keeping the time at which each resource is next
free: the issuing CPU thread, the compute stream (GPU only), the all-gather
stream, and the process group that serializes every collective. The rules
follow ``torch/distributed/fsdp/_fully_shard/`` (torch 2.13); each rule cites
the function it models (docs/architecture.md, "Where each FSDP2 rule is
modelled", maps them).

[Note: CPU device]
On a CPU device there are no streams: compute blocks the issuing thread, a
collective with ``async_op=False`` blocks it too, and only ``async_op=True``
all-gathers run beside compute (in the gloo backend's threads). The
reduce-scatter in ``foreach_reduce`` is always issued with ``async_op=False``,
so on CPU it blocks the thread, queued behind any all-gather still in flight
on the same process group.
Compute and the gloo threads share the same cores: while they overlap, both
progress at ``1 / overlap_slowdown`` of their speed (a calibrated parameter),
so an overlap of ``x`` ms costs ``x * (overlap_slowdown - 1)`` ms on the
compute and on every collective in flight. Slowing the compute alone would
let a communication-bound step hide all of its compute for free, which the
CPU reference workloads do not show (bench/fidelity.py).
Simplification: gloo runs up to two collectives of a process group at once
(``ProcessGroupGloo`` options, ``threads=2``); they are modelled one after
another. The fidelity runs show where that matters: the model makes deeper
explicit backward prefetch with async unshard 1-3% slower per level (the
synchronous reduce-scatter waits behind one more all-gather), while on 5 of
5 saved runs measured depth 3 was within noise of depth 1 or faster.

[Note: Model structure]
The torchtitan pattern: ``fully_shard`` per block, then the root. The root's
own compute is split into the part before the first nested module
(``fwd_pre_ms`` / ``bwd_pre_ms``, e.g. embedding in forward, LM head in
backward) and the rest. Deeper nesting is simulated as siblings in
post-forward order.

[Note: Memory in program order]
Peak memory is the running sum of allocations and frees in the order the CPU
issues them, which is what the caching allocator accounts (stream-ordered
reuse follows the issuing order). Baseline: sharded parameters and
gradients plus optimizer state.

[Note: Post-optimizer event]
``FSDPState._root_pre_forward`` makes the all-gather streams wait for the
current stream (or the ``set_post_optim_event`` event): the first all-gather
of a step never overlaps the previous optimizer step. Simulating one step that
starts at 0, this is the initial state of every resource.

[Note: Speed]
Profiling the pure-Python version showed the time spread over small calls
(about 9,000 evaluations/s at 32 modules, against a 20,000 target), so the
step is one numeric kernel (:mod:`planner.simulation._kernel`) compiled by numba, over
per-module arrays built once per profile (:class:`planner.simulation._kernel.ProfileArrays`,
cached on the profile) and once per plan (:class:`planner.simulation._kernel.PlanArrays`,
cached on the plan). The same kernel writes the trace, so traced and
untraced runs cannot disagree. ``bench/simulator_speed.py`` prints the
figures. Inside the kernel, the per-module functions take plain arrays and
callers check a module's state before calling them: passing bundles per
module, or calling unconditionally, made the step 2-3x slower ([Note: Arrays,
not bundles, in the hot path] in :mod:`planner.simulation._kernel.state`).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import numpy as np

from planner.simulation import _kernel
from planner.simulation._kernel import PlanArrays, ProfileArrays
from planner.artifacts.plan import Plan
from planner.artifacts.profile import Profile


@dataclass(frozen=True)
class SimParams:
    """Global parameters of the simulator, fitted by calibration.

    Attributes:
        issue_overhead_ms: CPU time spent in each FSDP hook (pre/post
            forward/backward), ms.
        overlap_slowdown: CPU device: while compute and a collective run at
            once they share the cores, and for the overlapped work both
            progress at ``1 / overlap_slowdown`` of their speed (>= 1; 2 is
            fair sharing of one core). No effect on GPU.
        collective_latency_ms: fixed cost added to every collective (copy-in,
            copy-out, launch), ms.
        comm_scale: factor on every measured collective time (isolated
            measurements after a barrier include rank skew; in a step they
            can run faster or slower).
        compute_scale: factor on every measured compute time (forward,
            backward, optimizer): the recorder times compute with parameters
            pre-unsharded and nothing else running; inside a real step caches
            and the allocator are colder.
    """

    issue_overhead_ms: float = 0.0
    overlap_slowdown: float = 1.0
    collective_latency_ms: float = 0.0
    comm_scale: float = 1.0
    compute_scale: float = 1.0

    def kernel_fields(self) -> tuple[float, ...]:
        """The fields of :class:`planner.simulation._kernel.KernelParams` as a plain tuple of floats (one compiled kernel)."""
        return (float(self.issue_overhead_ms), float(self.overlap_slowdown) - 1.0, float(self.comm_scale),
                float(self.collective_latency_ms), float(self.compute_scale))


class Track(enum.StrEnum):
    """A resource of the predicted timeline: one row of the trace."""

    COMPUTE = "compute"
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"
    CPU_WAIT = "cpu-wait"


@dataclass(frozen=True)
class TraceEvent:
    """One slice of the predicted timeline. Times in ms from step start.

    ``name`` is ``"<kind> <module FQN>"``, e.g. ``"all-gather layers.3"``
    (``<root>`` for the root).
    """

    name: str
    track: Track
    start_ms: float
    end_ms: float


@dataclass(frozen=True)
class SimResult:
    """What the simulator predicts for one plan.

    Attributes:
        step_ms: predicted step time (all microbatches' forward and backward,
            then the optimizer), ms.
        exposed_comm_ms: step time not covered by compute, ms.
        peak_bytes: predicted peak memory per rank, bytes: sharded
            parameters and optimizer state, plus the peak of what the step
            allocates at once (unsharded parameters, unsharded and sharded
            gradients, reduce-scatter buffers, activations, the optimizer's
            temporaries); [Note: Memory in program order].
        lower_bound_ms: ``max(sum of compute, sum of communication)`` with one
            all-gather and one reduce-scatter per module: no plan does better.
        compute_ms: total compute, ms.
        comm_ms: total communication this plan issues, ms.
        peak_unsharded_bytes: peak of the unsharded parameter bytes alive
            (all-gather outputs from issue to reshard), what the runtime can
            track on CPU through FSDP's own unshard/reshard.
        reserved_peak_bytes: ``peak_bytes`` plus the blocks freed but held
            from reuse at that moment (GPU, async unshard: [Note:
            record_stream holds all-gather outputs] in
            :mod:`planner.simulation._kernel.param_group`), what the caching allocator
            must reserve (compare ``torch.cuda.max_memory_reserved``); equal
            to ``peak_bytes`` on CPU.
        events: the timeline, when ``simulate(..., trace=True)``.
        memory: ``(time ms, bytes alive)`` samples, when traced.
    """

    step_ms: float
    exposed_comm_ms: float
    peak_bytes: int
    lower_bound_ms: float
    compute_ms: float
    comm_ms: float
    peak_unsharded_bytes: int = 0
    reserved_peak_bytes: int = 0
    events: list[TraceEvent] = field(default_factory=list)
    memory: list[tuple[float, int]] = field(default_factory=list)

    @property
    def ratio_to_lower_bound(self) -> float:
        """``step_ms / lower_bound_ms`` (1.0 is perfect overlap)."""
        return self.step_ms / self.lower_bound_ms if self.lower_bound_ms > 0 else float("inf")


def lower_bound_ms(profile: Profile) -> float:
    """``max(Σ compute, Σ (all-gather + reduce-scatter))`` for ``profile``, ms."""
    return _compiled(profile).lower_bound_ms


class _Compiled:
    """A profile as the kernel reads it: module names and indices, :class:`ProfileArrays` and its tuple."""

    def __init__(self, p: Profile):
        self.names = list(p.fingerprint.module_fqns)
        self.index = {f: i for i, f in enumerate(self.names)}
        mods = [p.modules[f] for f in self.names]
        f64, i64 = np.float64, np.int64
        root = self.index[p.root_fqn]
        r = mods[root]
        post = [self.index[f] for f in p.post_forward_order]
        self.arrays = ProfileArrays(
            all_gather_ms=np.array([m.all_gather_ms for m in mods], f64),
            reduce_scatter_ms=np.array([m.reduce_scatter_ms for m in mods], f64),
            forward_ms=np.array([m.fwd_ms / m.calls for m in mods], f64),
            backward_ms=np.array([m.bwd_ms / m.calls for m in mods], f64),
            unsharded_bytes=np.array([m.unsharded_bytes for m in mods], i64),
            grad_bytes=np.array([m.grad_bytes // m.calls for m in mods], i64),
            activation_bytes=np.array([m.activation_bytes // m.calls for m in mods], i64),
            sharded_bytes=np.array([m.sharded_bytes for m in mods], i64),
            children=np.array([self.index[f] for f in p.pre_forward_order if f != p.root_fqn], i64),
            post_forward=np.array(post, i64),
            root=root,
            root_post_index=len(post) - 1 - post[::-1].index(root),
            root_forward_pre_ms=float(r.fwd_pre_ms),
            root_forward_post_ms=float(r.fwd_ms - r.fwd_pre_ms),
            root_backward_pre_ms=float(r.bwd_pre_ms),
            root_backward_post_ms=float(r.bwd_ms - r.bwd_pre_ms),
            root_activation_pre_bytes=int(r.activation_bytes * r.fwd_pre_ms / r.fwd_ms) if r.fwd_ms > 0 else 0,
            gpu=p.fingerprint.device_type != "cpu",
            microbatches=int(p.microbatches),
            optimizer_ms=float(p.optimizer_ms),
            optimizer_temp_bytes=int(p.optimizer_temp_bytes),
        )
        self.fields = tuple(self.arrays)  # [Note: Plain tuples at the boundary] in planner.simulation._kernel
        self.baseline_bytes = sum(m.sharded_bytes for m in mods) + p.optimizer_state_bytes  # alive at step start
        compute = sum(m.fwd_ms + m.bwd_ms for m in mods) * p.microbatches + p.optimizer_ms
        self.lower_bound_ms = max(compute, sum(m.all_gather_ms + m.reduce_scatter_ms for m in mods))
        self.trace_rows = 8 * (len(post) + len(self.names)) * p.microbatches + 16


def _compiled(profile: Profile) -> _Compiled:
    c = profile.__dict__.get("_compiled")
    if c is None:
        c = _Compiled(profile)
        object.__setattr__(profile, "_compiled", c)  # a cache, not a field: equality and JSON ignore it
    return c


def _plan_fields(plan: Plan, c: _Compiled) -> tuple:
    """The fields of ``plan``'s :class:`PlanArrays` for the profile ``c`` (cached on the plan)."""
    cached = plan.__dict__.get("_arrays")
    if cached is not None and cached[0] is c:
        return cached[1]
    idx, n = c.index, len(c.names)
    fwd_lists, bwd_lists, raf, uib = [()] * n, [()] * n, [True] * n, [True] * n  # modules left out: FSDP2's defaults
    for fqn, m in plan.modules.items():
        i = idx[fqn]
        fwd_lists[i], bwd_lists[i], raf[i] = m.forward_prefetch, m.backward_prefetch, m.reshard_after_forward
        uib[i] = m.unshard_in_backward
    i64 = np.int64
    fields = tuple(PlanArrays(
        forward_prefetch_offsets=np.array([0, *itertools.accumulate(map(len, fwd_lists))], i64),
        forward_prefetch_targets=np.array([idx[t] for ts in fwd_lists for t in ts], i64),
        backward_prefetch_offsets=np.array([0, *itertools.accumulate(map(len, bwd_lists))], i64),
        backward_prefetch_targets=np.array([idx[t] for ts in bwd_lists for t in ts], i64),
        reshard_after_forward=np.array(raf, np.bool_),
        unshard_in_backward=np.array(uib, np.bool_),
        unshard_async_op=bool(plan.unshard_async_op),
        reduce_scatter_max_input_buffers=int(plan.reduce_scatter_max_input_buffers),
        reshard_after_backward=bool(plan.reshard_after_backward),
        separate_reduce_scatter_group=bool(plan.separate_reduce_scatter_group),
    ))
    object.__setattr__(plan, "_arrays", (c, fields))
    return fields


# Kernel event kinds (planner.simulation._kernel.FORWARD ...): name prefix and track.
_KINDS = ("forward", "backward", "optimizer", "all-gather", "reduce-scatter", "wait")
_TRACKS = (Track.COMPUTE, Track.COMPUTE, Track.COMPUTE, Track.ALL_GATHER, Track.REDUCE_SCATTER, Track.CPU_WAIT)
_NO_EVENTS = np.zeros((1, 4))
_NO_SAMPLES = np.zeros((1, 2))


def simulate(profile: Profile, plan: Plan, params: SimParams | None = None, trace: bool = False) -> SimResult:
    """Predict step time and peak memory of ``plan`` on ``profile``.

    Args:
        profile: the recorded profile (times ms, sizes bytes). With
            ``profile.microbatches > 1`` the step runs that many forward and
            backward passes (gradient accumulation), reduce-scattering only
            in the last (``set_requires_gradient_sync``).
        plan: the plan to simulate; FQNs must be modules of the profile.
        params: global parameters (default: the profile's calibration if it
            has one, else those solved from its in-step timings,
            :func:`planner.simulation.in_step.in_step_params`).
        trace: also return the timeline events and memory samples.

    Returns:
        A :class:`SimResult`.

    Raises:
        KeyError: the plan names a module the profile does not have (plans
            are validated against their fingerprint when loaded).
    """
    c = _compiled(profile)
    if params is None:
        params = SimParams(**profile.calibration) if profile.calibration else _uncalibrated(profile)
    events = np.zeros((c.trace_rows, 4)) if trace else _NO_EVENTS
    samples = np.zeros((c.trace_rows, 2)) if trace else _NO_SAMPLES
    t_cpu, t_compute, compute_ms, comm_ms, peak, peak_unsharded, reserved, n_events, n_samples = _kernel.step(
        c.fields, _plan_fields(plan, c), params.kernel_fields(), events, samples
    )
    step_ms = max(t_cpu, t_compute)
    timeline, memory = [], []
    if trace:
        for kind, i, start, end in events[:n_events].tolist():
            name = c.names[int(i)] or "<root>"
            timeline.append(TraceEvent(f"{_KINDS[int(kind)]} {name}", _TRACKS[int(kind)], start, end))
        memory = [(t, c.baseline_bytes + int(b)) for t, b in samples[:n_samples].tolist()]
    return SimResult(
        step_ms=step_ms,
        exposed_comm_ms=max(0.0, step_ms - compute_ms),
        peak_bytes=c.baseline_bytes + int(peak),
        lower_bound_ms=c.lower_bound_ms,
        compute_ms=compute_ms,
        comm_ms=comm_ms,
        peak_unsharded_bytes=int(peak_unsharded),
        reserved_peak_bytes=c.baseline_bytes + int(reserved),
        events=timeline,
        memory=memory,
    )


def _uncalibrated(profile: Profile) -> SimParams:
    """The profile's in-step parameters (cached on it by :func:`planner.simulation.in_step.in_step_params`)."""
    cached = profile.__dict__.get("_in_step_params")
    if cached is not None:
        return cached
    from planner.simulation.in_step import in_step_params  # in_step simulates: imported here, not at module level

    return in_step_params(profile)
