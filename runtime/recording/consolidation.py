"""Per-rank recorder figures into one Profile: the passes of one rank merged (:func:`merge_isolated`), then every
rank's consolidated (:func:`consolidate`: max across ranks, as the recorder's module docstring says)."""

from __future__ import annotations

import dataclasses
import functools
import statistics
from typing import Any

from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.profile import InStepTimings, ModuleProfile, Profile, backward_temporaries
from planner.artifacts.rank_measurements import (
    CollectiveMeasurements,
    ComputeMeasurements,
    IsolatedMeasurements,
    ModuleMeasurements,
    OverlapTimings,
    RankMeasurements,
)
from planner.traces.in_step_collectives import InStepCollective
from runtime.recording.peak_memory import peak_of_steps


def merge_isolated(parts: list[IsolatedMeasurements]) -> IsolatedMeasurements:
    """One rank's :func:`runtime.recording.isolated.isolated_measurements` from passes of a few modules each: each
    module's measurements from the parts that hold them; orders and forward calls from the first part (the same in
    every pass); the overlap microbenchmark from the part that ran it.

    Raises:
        ValueError: the parts disagree on the post-forward order.
    """
    return functools.reduce(IsolatedMeasurements.merged, parts)


def consolidate(per_rank: list[RankMeasurements], fingerprint: Fingerprint, resharding: dict[str, bool],
                calls: dict[str, int], microbatches: int = 1,
                rows: dict[str, tuple[tuple[int, int], ...]] | None = None) -> Profile:
    """The profile from every rank's figures (``record_profile``'s ``local``, gathered): max across ranks of every
    figure (the overlap timings: the mean); orders must agree across ranks.

    ``rows``: per FQN its :attr:`ModuleProfile.parameter_rows` (:func:`runtime.workload.parameter_rows`).

    Raises:
        RuntimeError: the ranks disagree on the post-forward order.
    """
    first = per_rank[0].isolated
    for other in per_rank[1:]:
        if other.isolated.post_forward_order != first.post_forward_order:
            raise RuntimeError(f"ranks disagree on the post-forward order: rank 0 {list(first.post_forward_order)}, "
                               f"rank {other.rank} {list(other.isolated.post_forward_order)}")
    unsharded = dict(zip(fingerprint.module_fqns, fingerprint.param_bytes, strict=True))
    modules = {fqn: _module_profile(fqn, unsharded[fqn], [r.isolated.modules[fqn] for r in per_rank], resharding[fqn],
                                    calls.get(fqn, 1), (rows or {}).get(fqn, ())) for fqn in fingerprint.module_fqns}
    root = fingerprint.module_fqns[0]
    overlap = None
    if first.overlap is not None:
        overlap = OverlapTimings(first.overlap.module,
                                 **{k: statistics.fmean(getattr(r.isolated.overlap, k) for r in per_rank)
                                    for k in ("all_gather_ms", "compute_ms", "overlapped_ms")})
    steps = [r.steps for r in per_rank]
    step_ms = max(s.step_ms for s in steps)
    ratios = [s.async_ratio for s in steps if s.async_ratio is not None]
    return Profile(
        fingerprint=fingerprint,
        pre_forward_order=(root, *first.pre_forward_order),
        post_forward_order=(*first.post_forward_order, root),
        modules=modules,
        optimizer_ms=max(s.optimizer_ms for s in steps),
        optimizer_state_bytes=max(s.optimizer_state_bytes for s in steps),
        measured_step_ms=step_ms,
        optimizer_temp_bytes=max(s.optimizer_temp_bytes for s in steps),
        measured_peak_bytes=peak_of_steps([list(s.peak_bytes) for s in steps]),
        microbatches=microbatches,
        per_rank=list(per_rank),
        consolidation="max",
        in_step=InStepTimings(default_step_ms=step_ms, overlap=overlap,
                              async_default_step_ms=step_ms * max(ratios) if ratios else None,
                              allocator=steps[0].allocator,
                              default_step_faults=_max_of([s.step_faults for s in steps]),
                              default_step_kernel_ms=_max_of([s.step_kernel_ms for s in steps])),
    )


def _module_profile(fqn: str, unsharded: int, ranks: list[ModuleMeasurements], resharding: bool, calls: int,
                    rows: tuple[tuple[int, int], ...] = ()) -> ModuleProfile:
    """One module's profile from every rank's figures of it: the max across ranks of each (needs its parameters in
    backward on any rank: needs them). ``unsharded``: its unsharded parameter bytes; ``rows``: its
    :attr:`ModuleProfile.parameter_rows`."""
    compute = [m.compute or ComputeMeasurements() for m in ranks]
    collectives = [m.collectives or CollectiveMeasurements(0.0, 0.0) for m in ranks]

    grad_pre = [c.grad_pre_bytes for c in compute if c.grad_pre_bytes is not None]
    grad_pre_bytes = max(grad_pre) if grad_pre else unsharded
    activation = int(max([c.activation_bytes for c in compute]))
    recompute_activation = int(max([c.recompute_activation_bytes for c in compute]))
    post = [c.activation_post_bytes for c in compute if c.activation_post_bytes is not None]
    fwd_ms, bwd_ms = max([c.fwd_ms for c in compute]), max([c.bwd_ms for c in compute])
    return ModuleProfile(
        fqn=fqn,
        fwd_ms=fwd_ms,
        bwd_ms=bwd_ms,
        fwd_pre_ms=min(max([c.fwd_pre_ms for c in compute]), fwd_ms),
        bwd_pre_ms=min(max([c.bwd_pre_ms for c in compute]), bwd_ms),
        all_gather_ms=max([c.all_gather_ms for c in collectives]),
        reduce_scatter_ms=max([c.reduce_scatter_ms for c in collectives]),
        unsharded_bytes=unsharded,
        sharded_bytes=int(max([c.sharded_bytes for c in collectives])),
        grad_bytes=unsharded,
        activation_bytes=activation,
        reshard_after_forward=resharding,
        needs_parameters_in_backward=any(c.needs_parameters_in_backward for c in compute),
        recompute_ms=max([c.recompute_ms for c in compute]),
        recompute_activation_bytes=recompute_activation,
        # the root's gradient before its children's backward (the LM head's), measured; the rest after
        backward_post_grad_bytes=max(0, unsharded - int(grad_pre_bytes)),
        # the root's saved bytes after its children's forward, freed before their backward
        activation_post_bytes=min(activation, int(max(post))) if post else 0,
        backward_temp_bytes=backward_temporaries(max([c.backward_peak_bytes for c in compute]),
                                                 min(unsharded, grad_pre_bytes), recompute_activation),
        calls=max(1, calls),
        parameter_rows=tuple(rows),
    )


def _max_of(values: list[Any]) -> Any:
    """The max across ranks; ``None`` where a rank did not measure it (the in-loop recorder)."""
    return None if any(v is None for v in values) else max(values)


def with_in_step_collectives(profile: Profile, collectives: dict[tuple[str, str], InStepCollective],
                             steps: int) -> Profile:
    """``profile`` with its modules' all-gather and reduce-scatter ms the transfer read inside ``steps`` traced steps,
    and the wait beside it ([Note: Collectives on NCCL's clock] in :mod:`planner.traces.in_step_collectives`); a
    module or kind no traced step holds keeps its isolated figure (a root with no parameter of its own, a collective
    that ran on no rank's every step)."""
    modules = {}
    for fqn, m in profile.modules.items():
        ag, rs = collectives.get((fqn, "all_gather")), collectives.get((fqn, "reduce_scatter"))
        modules[fqn] = dataclasses.replace(
            m, all_gather_ms=ag.transfer_ms if ag else m.all_gather_ms, all_gather_wait_ms=ag.wait_ms if ag else 0.0,
            reduce_scatter_ms=rs.transfer_ms if rs else m.reduce_scatter_ms,
            reduce_scatter_wait_ms=rs.wait_ms if rs else 0.0)
    in_step = dataclasses.replace(profile.in_step, collective_steps=steps) if profile.in_step is not None else None
    return dataclasses.replace(profile, modules=modules, in_step=in_step)
