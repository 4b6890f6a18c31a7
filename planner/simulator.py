"""Discrete-event simulator of one FSDP2 training step.

``simulate(profile, plan)`` walks the CPU thread through the hooks FSDP2 runs in
one step, in program order, and keeps the time at which each resource is next
free: the issuing CPU thread, the compute stream (GPU only), the all-gather
stream, and the process group that serializes every collective. The rules
follow ``torch/distributed/fsdp/_fully_shard/`` (torch 2.13); each method cites
the function it models.

[Note: CPU device]
On a CPU device there are no streams: compute blocks the issuing thread, a
collective with ``async_op=False`` blocks it too, and only ``async_op=True``
all-gathers run beside compute (in the gloo backend's threads). The
reduce-scatter in ``foreach_reduce`` is always issued with ``async_op=False``,
so on CPU it blocks the thread, queued behind any all-gather still in flight
on the same process group.

[Note: Model structure]
v1 models the torchtitan pattern: ``fully_shard`` per block, then the root.
The root's own compute is split into the part before the first nested module
(``fwd_pre_ms`` / ``bwd_pre_ms``, e.g. embedding in forward, LM head in
backward) and the rest. Deeper nesting is simulated as siblings in
post-forward order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.plan import Plan
from planner.profile import Profile

_SHARDED, _PENDING, _UNSHARDED = 0, 1, 2


@dataclass(frozen=True)
class SimParams:
    """Global parameters of the simulator, fitted by calibration.

    Attributes:
        issue_overhead_ms: CPU time spent in each FSDP hook (pre/post
            forward/backward), ms.
        overlap_slowdown: factor by which compute slows while a collective
            runs beside it (>= 1; CPU device: both compete for the cores).
    """

    issue_overhead_ms: float = 0.0
    overlap_slowdown: float = 1.0


@dataclass(frozen=True)
class TraceEvent:
    """One slice of the predicted timeline. Times in ms from step start."""

    name: str
    track: str  # "compute", "all-gather", "reduce-scatter", "cpu-wait"
    start_ms: float
    end_ms: float


@dataclass(frozen=True)
class SimResult:
    """What the simulator predicts for one plan.

    Attributes:
        step_ms: predicted step time (forward, backward, optimizer), ms.
        exposed_comm_ms: step time not covered by compute, ms.
        peak_bytes: predicted peak memory per rank, bytes (sharded state +
            optimizer state + the peak of unsharded parameters, gradients,
            reduce-scatter buffers and activations alive at once).
        lower_bound_ms: ``max(sum of compute, sum of communication)`` with one
            all-gather and one reduce-scatter per module: no plan does better.
        compute_ms: total compute, ms.
        comm_ms: total communication this plan issues, ms.
        events: the timeline, when ``simulate(..., trace=True)``.
        memory: ``(time ms, bytes alive)`` samples, when traced.
    """

    step_ms: float
    exposed_comm_ms: float
    peak_bytes: int
    lower_bound_ms: float
    compute_ms: float
    comm_ms: float
    events: list[TraceEvent] = field(default_factory=list)
    memory: list[tuple[float, int]] = field(default_factory=list)

    @property
    def ratio_to_lower_bound(self) -> float:
        """``step_ms / lower_bound_ms`` (1.0 is perfect overlap)."""
        return self.step_ms / self.lower_bound_ms if self.lower_bound_ms > 0 else float("inf")


def lower_bound_ms(profile: Profile) -> float:
    """``max(Σ compute, Σ (all-gather + reduce-scatter))`` for ``profile``, ms."""
    mods = profile.modules.values()
    compute = sum(m.fwd_ms + m.bwd_ms for m in mods) + profile.optimizer_ms
    comm = sum(m.all_gather_ms + m.reduce_scatter_ms for m in mods)
    return max(compute, comm)


def simulate(profile: Profile, plan: Plan, params: SimParams | None = None, trace: bool = False) -> SimResult:
    """Predict step time and peak memory of ``plan`` on ``profile``.

    Args:
        profile: the recorded profile (times ms, sizes bytes).
        plan: the plan to simulate; FQNs must be modules of the profile.
        params: calibrated global parameters (defaults: no overhead, no slowdown).
        trace: also return the timeline events and memory samples.

    Returns:
        A :class:`SimResult`.

    Raises:
        KeyError: the plan names a module the profile does not have (plans
            are validated against their fingerprint when loaded).
    """
    return _Step(profile, plan, params or SimParams(), trace).run()


class _Step:
    def __init__(self, profile: Profile, plan: Plan, params: SimParams, trace: bool):
        self.p = profile
        self.plan = plan
        self.params = params
        self.trace = trace
        self.gpu = profile.fingerprint.device_type != "cpu"
        self.async_op = plan.unshard_async_op
        self.t_cpu = 0.0
        self.t_compute = 0.0  # GPU compute stream
        self.pg_free = 0.0  # the process group is busy until then
        self.ag_stream_ready = 0.0  # GPU: all-gather stream waits on events until then
        self.prev_copy_out: float | None = None  # GPU implicit prefetch: all_gather_state event
        self.state = {fqn: _SHARDED for fqn in profile.modules}
        self.ag_end: dict[str, float] = {}
        self.mem: list[tuple[float, int, int]] = []  # (time, seq, delta bytes)
        self.events: list[TraceEvent] = []
        self.compute_total = 0.0
        self.comm_total = 0.0
        self.rs_inflight: list[tuple[float, int]] = []  # (end, buffer bytes), GPU
        self.rs_ends: list[float] = []

    # -- helpers ------------------------------------------------------------
    def _alloc(self, t: float, nbytes: int) -> None:
        self.mem.append((t, len(self.mem), nbytes))

    def _now(self) -> float:
        """Where the next compute-ordered operation happens."""
        return max(self.t_compute, self.t_cpu) if self.gpu else self.t_cpu

    def _hook(self) -> None:
        self.t_cpu += self.params.issue_overhead_ms

    def _compute(self, name: str, ms: float) -> tuple[float, float]:
        if self.gpu:
            start = max(self.t_compute, self.t_cpu)
            end = start + ms
            self.t_compute = end
        else:
            start = self.t_cpu
            overlap = max(0.0, min(self.pg_free, start + ms) - start)
            end = start + ms + overlap * (self.params.overlap_slowdown - 1.0)
            self.t_cpu = end
        self.compute_total += end - start
        if self.trace:
            self.events.append(TraceEvent(name, "compute", start, end))
        return start, end

    def _collective(self, name: str, track: str, issue: float, ms: float) -> tuple[float, float]:
        start = max(issue, self.pg_free)
        end = start + ms
        self.pg_free = end
        self.comm_total += ms
        if self.trace:
            self.events.append(TraceEvent(name, track, start, end))
        return start, end

    # -- FSDPParamGroup.unshard / wait_for_unshard / reshard -----------------
    def unshard(self, fqn: str) -> None:
        """``FSDPParamGroup.unshard``: no-op if pending or unsharded."""
        if self.state[fqn] != _SHARDED:
            return
        m = self.p.modules[fqn]
        issue = max(self.t_cpu, self.ag_stream_ready) if self.gpu else self.t_cpu
        start, end = self._collective(f"all-gather {fqn or '<root>'}", "all-gather", issue, m.all_gather_ms)
        # foreach_all_gather allocates the output before the collective
        self._alloc(start if self.gpu else self.t_cpu, m.unsharded_bytes)
        if not self.gpu and not self.async_op:
            self.t_cpu = end  # [Note: CPU device] a sync collective blocks the thread
        self.state[fqn] = _PENDING
        self.ag_end[fqn] = end

    def wait_for_unshard(self, fqn: str, forward: bool) -> None:
        """``FSDPParamGroup.wait_for_unshard``."""
        if self.state[fqn] != _PENDING:
            return
        end = self.ag_end[fqn]
        if self.gpu:
            self.t_compute = max(self.t_compute, end)
            if forward and not self.async_op:
                # Implicit prefetch keeps two all-gather outputs alive: the
                # all-gather streams wait for the previous copy-out before the
                # next all-gather ([Note: Overlapping all-gather copy-in and
                # all-gather] in _fsdp_param_group.py).
                if self.prev_copy_out is not None:
                    self.ag_stream_ready = max(self.ag_stream_ready, self.prev_copy_out)
                self.prev_copy_out = max(self.t_compute, self.t_cpu)
        else:
            if self.t_cpu < end and self.trace:
                self.events.append(TraceEvent(f"wait {fqn or '<root>'}", "cpu-wait", self.t_cpu, end))
            self.t_cpu = max(self.t_cpu, end)
        self.state[fqn] = _UNSHARDED

    def reshard(self, fqn: str) -> None:
        """``FSDPParamGroup.reshard``: frees the unsharded parameters."""
        if self.state[fqn] == _SHARDED:
            return
        if self.state[fqn] == _PENDING:  # FSDP waits on a stray unshard before freeing
            self.wait_for_unshard(fqn, forward=False)
        self._alloc(self._now(), -self.p.modules[fqn].unsharded_bytes)
        self.state[fqn] = _SHARDED

    # -- FSDPState hooks -----------------------------------------------------
    def pre_forward(self, fqn: str) -> None:
        """``FSDPState._pre_forward`` → ``FSDPParamGroup.pre_forward``, then explicit prefetch."""
        self._hook()
        self.unshard(fqn)
        self.wait_for_unshard(fqn, forward=True)
        for target in self.plan.modules[fqn].forward_prefetch:
            self.unshard(target)  # FSDPParamGroup._prefetch_unshard(..., "forward")

    def post_forward(self, fqn: str) -> None:
        """``FSDPParamGroup.post_forward``: reshard if ``reshard_after_forward``."""
        self._hook()
        if self.plan.modules[fqn].reshard_after_forward:
            self.reshard(fqn)

    def pre_backward(self, fqn: str, post_forward_index: int) -> None:
        """``FSDPState._pre_backward`` → ``FSDPParamGroup.pre_backward`` / ``_backward_prefetch``."""
        self._hook()
        self.unshard(fqn)
        self.wait_for_unshard(fqn, forward=False)
        explicit = self.plan.modules[fqn].backward_prefetch
        if explicit:
            for target in explicit:
                self.unshard(target)
        elif post_forward_index > 0:
            # default: the previous module in post-forward order
            self.unshard(self.p.post_forward_order[post_forward_index - 1])

    def post_backward(self, fqn: str) -> None:
        """``FSDPParamGroup.post_backward``: reshard, then reduce-scatter the gradient."""
        self._hook()
        m = self.p.modules[fqn]
        self.reshard(fqn)
        if self.gpu:
            # At most reduce_scatter_max_input_buffers RS inputs in flight: the
            # compute stream waits on the oldest before the next copy-in.
            while len(self.rs_inflight) >= self.plan.reduce_scatter_max_input_buffers:
                end, nbytes = self.rs_inflight.pop(0)
                self.t_compute = max(self.t_compute, end)
                self._alloc(self.t_compute, -nbytes)
            issue = max(self.t_compute, self.t_cpu)
            _, end = self._collective(f"reduce-scatter {fqn or '<root>'}", "reduce-scatter", issue, m.reduce_scatter_ms)
            self.rs_inflight.append((end, m.grad_bytes // m.calls))
        else:
            _, end = self._collective(f"reduce-scatter {fqn or '<root>'}", "reduce-scatter", self.t_cpu, m.reduce_scatter_ms)
            self.t_cpu = end
            self._alloc(end, -(m.grad_bytes // m.calls))
        self.rs_ends.append(end)

    def finalize_backward(self) -> None:
        """``FSDPState._root_post_backward_final_callback``: wait for every reduce-scatter."""
        last = max(self.rs_ends, default=0.0)
        if self.gpu:
            self.t_compute = max(self.t_compute, last)
            for _, nbytes in self.rs_inflight:
                self._alloc(self.t_compute, -nbytes)
            self.rs_inflight.clear()
        else:
            self.t_cpu = max(self.t_cpu, last)

    # -- the step ------------------------------------------------------------
    def run(self) -> SimResult:
        p = self.p
        root = p.root_fqn
        r = p.modules[root]
        children = [f for f in p.pre_forward_order if f != root]

        # Forward: root pre-forward (root unshard), root head, blocks, root tail.
        self.pre_forward(root)
        self._compute_fwd(root, r.fwd_pre_ms)
        for fqn in children:
            m = p.modules[fqn]
            self.pre_forward(fqn)
            self._compute_fwd(fqn, m.fwd_ms / m.calls)
            self.post_forward(fqn)
        self._compute_fwd(root, r.fwd_ms - r.fwd_pre_ms)
        self.post_forward(root)

        # Backward in reverse post-forward order; the root's pre-backward fires
        # first (its output's gradient), its post-backward last (final callback).
        root_index = len(p.post_forward_order) - 1 - p.post_forward_order[::-1].index(root)
        self.pre_backward(root, root_index)
        self._compute_bwd(root, r.bwd_pre_ms, free_activations=False)
        for index in range(len(p.post_forward_order) - 1, -1, -1):
            fqn = p.post_forward_order[index]
            if fqn == root:
                continue
            m = p.modules[fqn]
            self.pre_backward(fqn, index)
            self._compute_bwd(fqn, m.bwd_ms / m.calls, free_activations=True)
            self.post_backward(fqn)
        self._compute_bwd(root, r.bwd_ms - r.bwd_pre_ms, free_activations=True)
        self.post_backward(root)
        self.finalize_backward()

        # Optimizer step on the sharded parameters.
        if p.optimizer_ms > 0:
            self._compute("optimizer.step", p.optimizer_ms)
        step_ms = max(self.t_cpu, self.t_compute)

        baseline = sum(m.sharded_bytes * 2 for m in p.modules.values()) + p.optimizer_state_bytes
        alive, peak, samples = 0, 0, []
        for t, _, delta in sorted(self.mem):
            alive += delta
            peak = max(peak, alive)
            if self.trace:
                samples.append((t, baseline + alive))
        return SimResult(
            step_ms=step_ms,
            exposed_comm_ms=max(0.0, step_ms - self.compute_total),
            peak_bytes=baseline + peak,
            lower_bound_ms=lower_bound_ms(p),
            compute_ms=self.compute_total,
            comm_ms=self.comm_total,
            events=self.events,
            memory=samples,
        )

    def _compute_fwd(self, fqn: str, ms: float) -> None:
        if ms <= 0:
            return
        _, end = self._compute(f"forward {fqn or '<root>'}", ms)
        m = self.p.modules[fqn]
        share = ms / m.fwd_ms if m.fwd_ms > 0 else 1.0
        self._alloc(end, int(m.activation_bytes * share))  # saved for backward

    def _compute_bwd(self, fqn: str, ms: float, free_activations: bool) -> None:
        m = self.p.modules[fqn]
        start, end = self._compute(f"backward {fqn or '<root>'}", max(ms, 0.0))
        if free_activations:
            # this call's share of gradients appears; its activations are freed
            self._alloc(start, m.grad_bytes // m.calls)
            self._alloc(end, -int(m.activation_bytes / m.calls))
