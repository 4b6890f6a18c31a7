"""Discrete-event simulator of one FSDP2 training step: :class:`Simulator`.

A :class:`Simulator` holds one profile as the compiled kernel reads it (:mod:`planner.simulation._kernel`) and the
global parameters (:class:`SimParams`) it runs with; :meth:`Simulator.run` walks the CPU thread through the hooks
FSDP2 runs in one step, in program order, keeping the time at which each resource is next free: the issuing CPU
thread, the compute stream (GPU only), the all-gather stream, and the process group that serializes every
collective. The rules follow ``torch/distributed/fsdp/_fully_shard/`` (torch 2.13); each rule cites the function it
models (docs/architecture.md, "Where each FSDP2 rule is modelled", maps them). Which parameters a profile is
simulated with (its calibration, else those solved from its in-step timings) is
:mod:`planner.simulation.parameters`'s question.

[Note: CPU device]
On a CPU device there are no streams: compute blocks the issuing thread, a collective with ``async_op=False`` blocks
it too, and only ``async_op=True`` all-gathers run beside compute (in the gloo backend's threads). The
reduce-scatter in ``foreach_reduce`` is always issued with ``async_op=False``, so on CPU it blocks the thread; it
runs beside an all-gather still in flight, on gloo's second worker thread ([Note: Gloo's two worker threads] in
:mod:`planner.simulation._kernel.param_group`). Compute and the gloo threads share the same cores: while they
overlap, both progress at ``1 / overlap_slowdown`` of their speed, so an overlap of ``x`` ms costs
``x * (overlap_slowdown - 1)`` ms on the compute and on every collective in flight; a reduce-scatter beside an
all-gather shares them the same way. Slowing the compute alone would let a communication-bound step hide all of its
compute for free, which the CPU reference workloads do not show. Simplification: all-gathers issued together (a
prefetch list of two or more) run one after another, where gloo's two workers run two of them at once, sharing the
cores: both end near when the two in turn would (docs/decisions/rule-evidence.md).

[Note: Model structure]
The torchtitan pattern: ``fully_shard`` per block, then the root. The root's own compute is split into the part
before the first nested module (``fwd_pre_ms`` / ``bwd_pre_ms``, e.g. embedding in forward, LM head in backward) and
the rest. Deeper nesting is simulated as siblings in post-forward order.

[Note: Memory in program order]
Peak memory is the running sum of allocations and frees in the order the CPU issues them, which is what the caching
allocator accounts (stream-ordered reuse follows the issuing order). Baseline: sharded parameters and gradients plus
optimizer state.

[Note: Post-optimizer event]
``FSDPState._root_pre_forward`` makes the all-gather streams wait for the current stream, or, once, for the event
handed to ``set_post_optim_event`` (a plan's ``post_optim_event``: recorded right after ``optimizer.step()``,
``runtime.post_optim``). A simulated step starts at 0 with every resource free, except on GPU where the loop queues
stream work after the optimizer step and before the next forward (``Profile.post_optimizer_ms``: the next batch's
copy, metrics, an EMA update): the CPU has run ahead, so the step's compute stream starts that late. With FSDP2's
default the first all-gather waits for that work too (the all-gather streams start with the compute stream); with
the event it waits for the optimizer's end only (the start of the step), so it overlaps that work. On a CPU device
there are no streams and no events: the knob changes nothing, and no search samples it there.

[Note: Work outside the modules]
A step also runs work that is no module's forward or backward, no collective and not the optimizer: the loss,
``zero_grad``, FSDP2's hooks, the training loop (``Profile.outside_ms``; a CPU trace measures it:
``docs/decisions/statistics-evidence.md``). It is serial compute on the loop's thread and nothing of FSDP2's is in
flight around it in any plan: the loss runs after the last forward (no forward prefetch is left) and before the
first pre-backward hook issues a backward all-gather; ``zero_grad`` runs after the optimizer, which waits for every
reduce-scatter (``_root_post_backward_final_callback``). So it adds to the step as it is, scaled with the compute
(``compute_scale``), after the optimizer.

[Note: Speed]
The step is one numeric kernel compiled by numba, over per-module arrays built once per profile (:class:`Simulator`)
and once per plan (:meth:`Simulator.compile`: a caller that runs one plan many times, such as calibration, compiles
it once). The same kernel writes the trace, so traced and untraced runs cannot disagree. Inside the kernel, the
per-module functions take plain arrays and callers check a module's state before calling them ([Note: Arrays, not
bundles, in the hot path] in :mod:`planner.simulation._kernel.state`). ``python -m bench.simulator_speed`` prints
the figures."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import numpy as np

from planner.artifacts.knobs import DEFAULT_MODULE_KNOBS
from planner.artifacts.plan import Plan
from planner.artifacts.profile import Profile, root_activation_pre_bytes
from planner.errors import UnsupportedPlanError
from planner.simulation._kernel import PlanArrays, ProfileArrays, step_function


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
            can run faster or slower); on a re-targeted profile, on the
            hosts' share alone, not on what the target's link adds
            ([Note: The in-step scale is the hosts'] in
            :mod:`planner.simulation.link`).
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
        """The fields of :class:`planner.simulation._kernel.KernelParams`: a tuple of floats (one compiled kernel)."""
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
            then the optimizer, then the profile's work outside the modules), ms.
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


# Kernel event kinds (planner.simulation._kernel.state FORWARD ...): name prefix and track.
# The timeline's slice for the work outside the modules ([Note: Work outside the modules]).
OUTSIDE_EVENT = "outside <root>"
_KINDS = ("forward", "backward", "optimizer", "all-gather", "reduce-scatter", "wait")
_TRACKS = (Track.COMPUTE, Track.COMPUTE, Track.COMPUTE, Track.ALL_GATHER, Track.REDUCE_SCATTER, Track.CPU_WAIT)
_NO_EVENTS = np.zeros((1, 4), np.float32)  # the untraced placeholder ([Note: Trace capacity] in _kernel.timeline)
_NO_SAMPLES = np.zeros((1, 2), np.float32)


@dataclass(frozen=True)
class CompiledPlan:
    """A plan as one :class:`Simulator`'s kernel reads it (:meth:`Simulator.compile`).

    Attributes:
        plan: the plan.
        fields: its :class:`planner.simulation._kernel.PlanArrays` as a plain tuple.
        owner: the simulator it was compiled for (module indices are that profile's).
    """

    plan: Plan
    fields: tuple
    owner: Simulator = field(repr=False, compare=False)


class Simulator:
    """One FSDP2 step of ``profile``, predicted for any plan with ``params``.

    Builds the profile's kernel arrays once (O(modules)); each :meth:`run`
    costs one compiled step. The first simulator of a process compiles the
    kernel, or loads numba's cache ([Note: The kernel's numba cache] in
    :mod:`planner.simulation._kernel`).

    Args:
        profile: the recorded profile (times ms, sizes bytes). With
            ``profile.microbatches > 1`` the step runs that many forward and
            backward passes (gradient accumulation), reduce-scattering only
            in the last (``set_requires_gradient_sync``).
        params: the global parameters every :meth:`run` uses unless given
            others (:func:`planner.simulation.parameters.profile_params`: the
            profile's calibration, else its in-step parameters).

    Attributes:
        profile, params: as given.
        lower_bound_ms: ``max(sum of compute, sum of all-gather and
            reduce-scatter)`` with one all-gather and one reduce-scatter per
            module, ms: no plan does better.
    """

    def __init__(self, profile: Profile, params: SimParams):
        self.profile = profile
        self.params = params
        self._step = step_function()
        self._names = list(profile.fingerprint.module_fqns)
        self._index = {f: i for i, f in enumerate(self._names)}
        mods = [profile.modules[f] for f in self._names]
        f64, i64 = np.float64, np.int64
        root = self._index[profile.root_fqn]
        r = mods[root]
        post = [self._index[f] for f in profile.post_forward_order]
        rs_scale = profile.fingerprint.reduce_scatter_scale()  # mixed precision: reduce_dtype over param_dtype
        # [Note: The in-step scale is the hosts'] in planner.simulation.link: the links' share, unscaled
        link = (np.array([m.all_gather_link_ms for m in mods], f64),
                np.array([m.reduce_scatter_link_ms for m in mods], f64))
        self._link_ms = link if link[0].any() or link[1].any() else None
        self._scaled: tuple[float, tuple] | None = None  # the last comm_scale's arrays, where self._link_ms
        self._arrays = dict(  # ProfileArrays' fields ([Note: Plain tuples at the boundary] in ..._kernel.hooks)
            all_gather_ms=np.array([m.all_gather_ms for m in mods], f64),
            reduce_scatter_ms=np.array([m.reduce_scatter_ms for m in mods], f64),
            forward_ms=np.array([m.fwd_ms / m.calls for m in mods], f64),
            backward_ms=np.array([m.bwd_ms / m.calls for m in mods], f64),
            unsharded_bytes=np.array([m.unsharded_bytes for m in mods], i64),
            grad_bytes=np.array([m.grad_bytes // m.calls for m in mods], i64),
            reduce_scatter_bytes=np.array([round(m.grad_bytes // m.calls * rs_scale) for m in mods], i64),
            activation_bytes=np.array([m.activation_bytes // m.calls for m in mods], i64),
            recompute_bytes=np.array([m.recompute_activation_bytes // m.calls for m in mods], i64),
            backward_temp_bytes=np.array([m.backward_temp_bytes for m in mods], i64),
            sharded_bytes=np.array([m.sharded_bytes for m in mods], i64),
            children=np.array([self._index[f] for f in profile.pre_forward_order if f != profile.root_fqn], i64),
            post_forward=np.array(post, i64),
            root=root,
            root_post_index=len(post) - 1 - post[::-1].index(root),
            root_forward_pre_ms=float(r.fwd_pre_ms),
            root_forward_post_ms=float(r.fwd_ms - r.fwd_pre_ms),
            root_backward_pre_ms=float(r.bwd_pre_ms),
            root_backward_post_ms=float(r.bwd_ms - r.bwd_pre_ms),
            root_activation_pre_bytes=root_activation_pre_bytes(r),
            root_post_grad_bytes=min(int(r.backward_post_grad_bytes), int(r.grad_bytes)),
            gpu=profile.fingerprint.device_type != "cpu",
            single_rank=profile.fingerprint.world_size == 1,
            microbatches=int(profile.microbatches),
            optimizer_ms=float(profile.optimizer_ms),
            optimizer_temp_bytes=int(profile.optimizer_temp_bytes),
            post_optimizer_ms=float(profile.post_optimizer_ms),
        )
        self._fields = tuple(ProfileArrays(**self._arrays))
        self._default_module_knobs = np.tile(np.array(DEFAULT_MODULE_KNOBS.as_array(), np.int64),
                                             (len(self._names), 1))
        self._baseline_bytes = sum(m.sharded_bytes for m in mods) + profile.optimizer_state_bytes  # alive at start
        self._outside_ms = float(profile.outside_ms)  # [Note: Work outside the modules]
        post_optimizer = profile.post_optimizer_ms if profile.fingerprint.device_type != "cpu" else 0.0
        compute = (sum(m.fwd_ms + m.bwd_ms for m in mods) * profile.microbatches + profile.optimizer_ms
                   + self._outside_ms + post_optimizer)
        self.lower_bound_ms = max(compute, sum(m.all_gather_ms + m.reduce_scatter_ms for m in mods))
        self._trace_rows = 8 * (len(post) + len(self._names)) * profile.microbatches + 16

    def _scaled_fields(self, comm_scale: float) -> tuple:
        """The kernel's profile arrays for ``comm_scale`` where the profile keeps a link's share apart: each
        collective as ``host + link / comm_scale``, so the kernel's ``comm_scale *`` scales the hosts' work alone
        ([Note: The in-step scale is the hosts'] in :mod:`planner.simulation.link`). One build per scale."""
        if self._scaled is None or self._scaled[0] != comm_scale:
            a, (ag_link, rs_link) = self._arrays, self._link_ms
            self._scaled = comm_scale, tuple(ProfileArrays(**{
                **a, "all_gather_ms": a["all_gather_ms"] - ag_link + ag_link / comm_scale,
                "reduce_scatter_ms": a["reduce_scatter_ms"] - rs_link + rs_link / comm_scale}))
        return self._scaled[1]

    def compile(self, plan: Plan) -> CompiledPlan:
        """``plan`` as this simulator's kernel reads it; run it many times at the cost of one build.

        Raises:
            KeyError: the plan names a module the profile does not have
                (plans are validated against their fingerprint when loaded).
            UnsupportedPlanError: a module reshards to a number of ranks after forward (an integer
                ``reshard_after_forward``): its post-forward mesh, memory and backward all-gather are not modelled.
        """
        idx, n = self._index, len(self._names)
        fwd_lists, bwd_lists, resharding = [()] * n, [()] * n, [True] * n  # left out: FSDP2's defaults
        module_knobs = self._default_module_knobs  # read-only in the kernel: shared until a module sets its own
        for fqn, m in plan.modules.items():
            i = idx[fqn]
            fwd_lists[i], bwd_lists[i], resharding[i] = m.forward_prefetch, m.backward_prefetch, m.reshard_after_forward
            if m.knobs is not DEFAULT_MODULE_KNOBS and m.knobs.changed:
                if module_knobs is self._default_module_knobs:
                    module_knobs = module_knobs.copy()
                module_knobs[i] = m.knobs.as_array()
        ranks_at = [i for i, r in enumerate(resharding) if not isinstance(r, bool | np.bool_)]
        if ranks_at:
            fqn, ranks = self._names[ranks_at[0]], resharding[ranks_at[0]]
            raise UnsupportedPlanError(f"{fqn or 'the root'} reshards to {ranks} ranks after forward "
                                       f"(reshard_after_forward={ranks}): the simulator models True and False only; "
                                       "measure it instead")
        i64 = np.int64
        fields = tuple(PlanArrays(
            forward_prefetch_offsets=np.array([0, *itertools.accumulate(map(len, fwd_lists))], i64),
            forward_prefetch_targets=np.array([idx[t] for ts in fwd_lists for t in ts], i64),
            backward_prefetch_offsets=np.array([0, *itertools.accumulate(map(len, bwd_lists))], i64),
            backward_prefetch_targets=np.array([idx[t] for ts in bwd_lists for t in ts], i64),
            reshard_after_forward=np.array(resharding, np.bool_),
            knobs=tuple(plan.knobs.as_array()),
            module_knobs=module_knobs,
        ))
        return CompiledPlan(plan, fields, self)

    def run(self, plan: Plan | CompiledPlan, params: SimParams | None = None, trace: bool = False) -> SimResult:
        """Predict step time and peak memory of ``plan``.

        Args:
            plan: a plan of this profile's modules, or one :meth:`compile` d by this simulator.
            params: instead of :attr:`params`, for this run.
            trace: also return the timeline events and memory samples.

        Returns:
            A :class:`SimResult`.

        Raises:
            KeyError: the plan names a module the profile does not have.
            ValueError: ``plan`` was compiled by another simulator.
        """
        compiled = plan if isinstance(plan, CompiledPlan) else self.compile(plan)
        if compiled.owner is not self:
            raise ValueError("this plan was compiled by another Simulator; compile it with this one")
        kernel_params = (params or self.params).kernel_fields()
        fields = self._fields if self._link_ms is None else self._scaled_fields((params or self.params).comm_scale)
        rows = self._trace_rows
        while True:
            events = np.zeros((rows, 4)) if trace else _NO_EVENTS
            samples = np.zeros((rows, 2)) if trace else _NO_SAMPLES
            t_cpu, t_compute, compute_ms, comm_ms, peak, peak_unsharded, reserved, n_events, n_samples = self._step(
                fields, compiled.fields, kernel_params, events, samples)
            if not trace or max(n_events, n_samples) <= rows:
                break
            rows = int(max(n_events, n_samples))  # again, with room for every row ([Note: Trace capacity])
        end_of_modules = max(t_cpu, t_compute)
        outside = self._outside_ms * (params or self.params).compute_scale  # [Note: Work outside the modules]
        step_ms, compute_ms = end_of_modules + outside, compute_ms + outside
        timeline, memory = [], []
        if trace:
            for kind, i, start, end in events[:n_events].tolist():
                name = self._names[int(i)] or "<root>"
                timeline.append(TraceEvent(f"{_KINDS[int(kind)]} {name}", _TRACKS[int(kind)], start, end))
            if outside > 0:
                timeline.append(TraceEvent(OUTSIDE_EVENT, Track.COMPUTE, end_of_modules, step_ms))
            memory = [(t, self._baseline_bytes + int(b)) for t, b in samples[:n_samples].tolist()]
        return SimResult(
            step_ms=step_ms,
            exposed_comm_ms=max(0.0, step_ms - compute_ms),
            peak_bytes=self._baseline_bytes + int(peak),
            lower_bound_ms=self.lower_bound_ms,
            compute_ms=compute_ms,
            comm_ms=comm_ms,
            peak_unsharded_bytes=int(peak_unsharded),
            reserved_peak_bytes=self._baseline_bytes + int(reserved),
            events=timeline,
            memory=memory,
        )
