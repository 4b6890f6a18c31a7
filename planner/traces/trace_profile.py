"""A :class:`~planner.artifacts.profile.Profile` from every rank's ``torch.profiler`` trace.

The same profile the recorder writes (``runtime.recording.recorder``), from what a training job's own traces hold
(:mod:`planner.traces.fsdp_steps`), consolidated as the recorder consolidates: per rank the median over steps,
then the max across ranks. Two figures differ in kind from the recorder's and say so:

- Collectives: the recorder times each alone after a barrier; in a step, a rank that arrives first waits for the
  others inside the collective, and one that arrives last may find the peers' data already sent and finish early
  (gloo). Neither rank's own time is the collective's. So each call is paired across ranks (the n-th of its
  module and kind in the same step) and each rank's time is taken less its wait for the last rank to start, on
  the host clock (:func:`_collective_ms`), with FSDP2's copies around the transfer; the most of the ranks, then
  the mean over calls ([Note: A collective's figure is the mean of its calls]).
- What a trace does not hold is estimated and named in :attr:`Profile.estimated` and in :class:`TraceProfile`'s
  ``missing``, each with what it costs; a ``fingerprint`` from the model replaces the estimated one.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.profile import InStepTimings, ModuleProfile, Profile, backward_temporaries
from planner.errors import TraceFormatError
from planner.traces.fsdp_steps import Collective, RankStep, rank_steps
from planner.traces.kineto import TORCH_DTYPE, KinetoTrace, read_trace, trace_files

# Optimizer state per byte of sharded parameters, by the optimizer's class name in ``Optimizer.step#Name.step``.
STATE_PER_PARAM_BYTE = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "SGD": 1, "Adagrad": 1,
                        "RMSprop": 1}


@dataclass(frozen=True)
class Missing:
    """A figure the traces did not hold: what stands in for it, and what that costs."""

    figure: str
    stand_in: str
    cost: str

    def line(self) -> str:
        return f"{self.figure}: {self.stand_in}; {self.cost}"


@dataclass(frozen=True)
class TraceProfile:
    """The profile built from traces, and what it could not get (:class:`Missing`, in the order found).

    ``rank_skew_ms``: the most any rank waited in a step for a late rank to start the collectives (median over
    steps), ms; ``None`` with one rank's trace. Not missing from the profile: the late rank's work that the
    others wait for is in each call's figure (the most of the ranks).
    ``outside_ms``: on CPU, the step's time outside the modules' compute, the collectives (waits included) and
    the optimizer: the loss, ``zero_grad``, FSDP2's hooks and the loop; per rank the median over steps, the most
    of the ranks, ms; the profile's ``outside_ms``, which the simulator adds to the step ([Note: Work outside the
    modules] in :mod:`planner.simulation.simulator`). ``None`` on GPU, where the stretches overlap and do not sum
    to the step (:attr:`missing` names it).
    """

    profile: Profile
    missing: tuple[Missing, ...]
    steps: int
    ranks: tuple[int, ...]
    rank_skew_ms: float | None = None
    outside_ms: float | None = None


def profile_from_traces(paths: list[str], fingerprint: Fingerprint | None = None) -> TraceProfile:
    """Build a profile from one trace per rank (files, or directories of ``*.json``/``*.json.gz``).

    Args:
        paths: the traces; each file's rank is its ``distributedInfo.rank``, else a ``rank<N>`` in its name,
            else its position. A rank may have several files, each other steps of the job (``torch.profiler``'s
            ``schedule(..., repeat=N)`` writes one per cycle; torchtitan one per ``iteration_N`` folder): their steps
            are taken together ([Note: Several traces of one rank]).
        fingerprint: the model's own (``runtime.apply.model_fingerprint``); ``None``: estimated from the traces
            (parameter counts padded to the world size, so a plan made on it names the model's modules but
            its ``apply`` check needs the real counts).

    Raises:
        TraceFormatError: a file that cannot be read or is not a Kineto trace; no FSDP2 labels; two files of
            one rank that hold the same step; traces of different world sizes; ranks that disagree on the
            post-forward order; a fingerprint that names other modules than the traces. The message names the
            files.
    """
    traces = _by_rank([read_trace(p) for p in trace_files(paths)])
    per_rank = {rank: _steps_of_rank(rank, files) for rank, files in traces.items()}
    first_rank = min(per_rank)
    first = per_rank[first_rank][0]
    for rank, steps in per_rank.items():
        for s in steps:
            if s.post_forward_order != first.post_forward_order:
                raise TraceFormatError(
                    f"ranks disagree on the post-forward order: {first.path!r} (rank {first_rank}) has "
                    f"{list(first.post_forward_order)}, {s.path!r} (rank {rank}, step {s.number}) has "
                    f"{list(s.post_forward_order)}; give traces of the same steps of one job")
    return _consolidate({rank: files[0] for rank, files in traces.items()}, per_rank, fingerprint)


def _by_rank(traces: list[KinetoTrace]) -> dict[int, list[KinetoTrace]]:
    out: dict[int, list[KinetoTrace]] = defaultdict(list)
    worlds = {t.world_size for t in traces if t.world_size is not None}
    if len(worlds) > 1:
        raise TraceFormatError(f"the traces come from different world sizes {sorted(worlds)}: "
                               + ", ".join(f"{t.path!r} ({t.world_size})" for t in traces))
    named = [t.rank if t.rank is not None else int(m.group(1)) if (m := re.search(r"rank[_-]?(\d+)", Path(t.path).name))
             else None for t in traces]
    for i, (t, own) in enumerate(zip(traces, named, strict=True)):
        rank = own if own is not None else i
        if None in named and out.get(rank):  # a position is a rank only when no file names its own
            raise TraceFormatError(f"two traces of rank {rank}: {out[rank][0].path!r} and {t.path!r}; give each "
                                   "rank's trace its distributedInfo or a rank<N> in its name")
        out[rank].append(t)
    return dict(sorted(out.items()))


# [Note: Several traces of one rank]
# A job traced with ``torch.profiler.schedule(wait, warmup, active, repeat=N)`` writes one file per rank and cycle,
# torchtitan one folder per profiled iteration (``profiling/traces/iteration_N/rank{R}_trace.json``). The files of
# one rank are other steps of the same job, and their steps are pooled: each step's ``ProfilerStep#N`` is the
# profiler's own count, so steps of different cycles have different numbers, and the collectives of step N are
# paired across ranks by it. Two files of one rank that hold the same step number are two runs, or one file given
# twice, and are refused. Short cycles also perturb less: the profiler buffers every event of a cycle's active
# steps in the process, and a long cycle's later steps run slow beside that work, the collectives most; one active
# step a cycle, as torchtitan traces, runs as fast as an untraced step (docs/decisions/profiler-cycles.md).


def _steps_of_rank(rank: int, files: list[KinetoTrace]) -> list[RankStep]:
    """One rank's steps from its files, in step order.

    Raises:
        TraceFormatError: two files hold the same step (``ProfilerStep#N``), or one file has no whole step.
    """
    seen: dict[int, str] = {}
    steps = []
    for trace in files:
        for s in rank_steps(trace):
            if s.number in seen:
                raise TraceFormatError(f"two traces of rank {rank} hold step {s.number}: {seen[s.number]!r} and "
                                       f"{trace.path!r}; give each step of a rank once (one trace per rank and "
                                       "profiler cycle, of one job)")
            seen[s.number] = trace.path
            steps.append(s)
    return sorted(steps, key=lambda s: s.number)


def _median_max(values_per_rank: list[list[float]]) -> float:
    """Per rank the median, then the max across ranks (the recorder's consolidation)."""
    return max(statistics.median(v) for v in values_per_rank if v)


def _consolidate(traces: dict[int, KinetoTrace], per_rank: dict[int, list[RankStep]],
                 fingerprint: Fingerprint | None) -> TraceProfile:
    first = per_rank[min(per_rank)][0]
    world = next((t.world_size for t in traces.values() if t.world_size), len(traces))
    device = next(iter(traces.values())).device_type
    modules = tuple(dict.fromkeys(first.pre_forward_order))
    missing: list[Missing] = []
    if len(traces) < world:
        missing.append(Missing("ranks", f"{len(traces)} of {world} traces", "the max across ranks sees only those"))

    comm, sizes, dtype_bytes, waits = _collectives(per_rank)
    estimated: list[str] = []
    fingerprint = _checked_fingerprint(fingerprint, modules, sizes, (world, device, dtype_bytes), missing, estimated)
    unsharded = dict(zip(fingerprint.module_fqns, fingerprint.param_bytes, strict=True))
    if world == 1:  # FSDPParamGroup.unshard copies the sharded parameters and returns before any all-gather label
        missing.append(Missing("collectives", "none: FSDP2 runs no all-gather or reduce-scatter at world size 1, and "
                               "reshard_after_forward is taken as FSDP2's default (every module but the root)",
                               "nothing for this world size; trace the job at the world size you will tune"))
    module_profiles = {fqn: _module_profile(fqn, unsharded[fqn], per_rank, comm, sizes, world)
                       for fqn in fingerprint.module_fqns}
    step_ms = _median_max([[s.step_ms for s in steps] for steps in per_rank.values()])
    skew = statistics.median(max(w) for w in waits.values()) if len(per_rank) > 1 and waits else None
    outside = _median_max([[_outside_ms(s) for s in steps] for steps in per_rank.values()]) if device == "cpu" else None
    if outside is None:
        missing.append(Missing("work outside the modules", "0 ms",
                               "on GPU the loop's CPU work overlaps the kernels and the stretches do not sum to the "
                               "step; the loss's kernels and whatever of the loop the step waits for are in no figure"))
    optimizer_ms = [[s.optimizer_ms for s in steps if s.optimizer_ms is not None] for steps in per_rank.values()]
    if not any(optimizer_ms):
        missing.append(Missing("optimizer step", "0 ms", "no Optimizer.step# label in the steps profiled"))
    sharded_total = sum(m.sharded_bytes for m in module_profiles.values())
    state_bytes = _optimizer_state_bytes(first.optimizer, sharded_total, missing, estimated)
    peak = _peak(per_rank, device, sharded_total + state_bytes, missing, estimated)
    in_step = InStepTimings(default_step_ms=step_ms, overlap=None)
    if device == "cpu":
        estimated.append("in_step.overlap")
        missing.append(Missing("CPU overlap slowdown", "the simulator's default",
                               "the trace holds no all-gather and compute alone and at once; steps that overlap "
                               "them are predicted less well than from `prefetch-planner profile`"))
    temp = [[s.optimizer_temp_bytes for s in steps if s.optimizer_temp_bytes is not None]
            for steps in per_rank.values()]
    profile = Profile(
        fingerprint=fingerprint, pre_forward_order=first.pre_forward_order,
        post_forward_order=first.post_forward_order, modules=module_profiles,
        optimizer_ms=_median_max(optimizer_ms) if any(optimizer_ms) else 0.0,
        optimizer_state_bytes=state_bytes, optimizer_temp_bytes=int(_median_max(temp)) if any(temp) else 0,
        measured_step_ms=step_ms, measured_peak_bytes=peak, microbatches=first.microbatches,
        consolidation="max", in_step=in_step, source="trace", estimated=tuple(estimated),
        outside_ms=outside or 0.0,
    )
    return TraceProfile(profile, tuple(missing), min(len(s) for s in per_rank.values()), tuple(per_rank), skew,
                        outside)


def _module_profile(fqn: str, nbytes: int, per_rank: dict[int, list[RankStep]],
                    comm: dict[tuple[str, str], list[float]], sizes: dict[tuple[str, str], int],
                    world: int) -> ModuleProfile:
    """Module ``fqn``'s figures across ranks and steps: times the median over steps of the max across ranks (per
    microbatch), collectives the mean per call, memory from the first rank's steps. ``nbytes``: its unsharded
    parameter bytes."""
    first = per_rank[min(per_rank)][0]

    def per_module(attr: str) -> float:
        return _median_max([[getattr(s, attr).get(fqn, 0.0) / s.microbatches for s in steps]
                            for steps in per_rank.values()])

    fwd, bwd = per_module("fwd_ms"), per_module("bwd_ms")
    ag, rs = comm.get((fqn, "all_gather"), []), comm.get((fqn, "reduce_scatter"), [])
    resharded = fqn in first.resharded if world > 1 else fqn != ""
    act = statistics.median(s.activation_bytes.get(fqn, 0) for s in per_rank[min(per_rank)])
    if not resharded:
        act = max(0, act - nbytes)  # its unsharded parameters stay allocated after its forward
    grad = sizes.get((fqn, "reduce_scatter"), nbytes)
    post = min(grad, int(_median_max([[s.root_backward_post_bytes or 0 for s in ss] for ss in per_rank.values()])))
    post = post if fqn == "" else 0  # the root's gradient after its children's backward (the embedding's)
    recompute = int(max(s.recompute_bytes.get(fqn, 0) for ss in per_rank.values() for s in ss))
    # the root's activations after its children's forward, freed before their backward (0: no memory events)
    after = 0 if fqn else min(int(act), int(statistics.median(
        s.root_forward_post_bytes or 0 for s in per_rank[min(per_rank)])))
    return ModuleProfile(
        fqn=fqn, fwd_ms=fwd, bwd_ms=bwd, fwd_pre_ms=min(per_module("fwd_pre_ms"), fwd),
        bwd_pre_ms=min(per_module("bwd_pre_ms"), bwd),
        all_gather_ms=statistics.fmean(ag) if ag else 0.0, reduce_scatter_ms=statistics.fmean(rs) if rs else 0.0,
        unsharded_bytes=nbytes, sharded_bytes=-(-nbytes // world),
        grad_bytes=grad, activation_bytes=int(act),
        recompute_ms=per_module("recompute_ms"),
        recompute_activation_bytes=recompute,
        backward_temp_bytes=backward_temporaries(
            _median_max([[s.backward_peak_bytes.get(fqn, 0) for s in ss] for ss in per_rank.values()]),
            grad - post, recompute), backward_post_grad_bytes=post, activation_post_bytes=after,
        reshard_after_forward=resharded, calls=max(1, first.post_forward_order.count(fqn)),
    )


def _checked_fingerprint(fingerprint: Fingerprint | None, modules: tuple[str, ...], sizes: dict[tuple[str, str], int],
                         world_device_dtypes: tuple[int, str, set[int]], missing: list[Missing],
                         estimated: list[str]) -> Fingerprint:
    """The model's fingerprint, checked against the traces' FSDP modules; without one, estimated from the
    all-gather sizes (noted in ``missing`` and ``estimated``).

    Raises:
        TraceFormatError: the model's FSDP modules are not the traces'.
    """
    if fingerprint is None:
        estimated.append("fingerprint")
        missing.append(Missing("parameter counts", "all-gather sizes, padded to the world size" if sizes else "none "
                               "(record with record_shapes=True)", "plans name the modules but `apply` checks the "
                               "counts: pass --model FACTORY for the model's own"))
        return _estimated_fingerprint(modules, sizes, *world_device_dtypes)
    if tuple(fingerprint.module_fqns) and set(fingerprint.module_fqns) != set(modules):
        raise TraceFormatError(f"the model's FSDP modules {list(fingerprint.module_fqns)} are not the traces' "
                               f"{list(modules)}; give --model the factory of the traced job")
    return fingerprint


def _collectives(per_rank: dict[int, list[RankStep]]) -> tuple[dict[tuple[str, str], list[float]],
                                                                 dict[tuple[str, str], int], set[int],
                                                                 dict[int, list[float]]]:
    """Each call's time across ranks (:func:`_collective_ms`), per ``(module, kind)``; the bytes each moves; the
    element sizes seen; and per step, per rank, the ms it waited for the last rank to join (rank skew)."""
    comm: dict[tuple[str, str], list[float]] = defaultdict(list)
    sizes: dict[tuple[str, str], int] = {}
    dtype_bytes: set[int] = set()
    calls: dict[tuple[int, str, str, int], list[Collective]] = defaultdict(list)
    for steps in per_rank.values():
        for s in steps:
            for c in s.collectives:
                calls[(s.number, c.module, c.kind, c.ordinal)].append(c)
                if c.bytes is not None:
                    sizes[(c.module, c.kind)] = c.bytes
                    dtype_bytes.add(c.dtype_bytes)
    waits: dict[int, list[float]] = defaultdict(lambda: [0.0] * len(per_rank))
    for (number, module, kind, _), ranks_calls in calls.items():
        comm[(module, kind)].append(_collective_ms(ranks_calls))
        last = max(c.start_us for c in ranks_calls)
        if len(ranks_calls) == len(per_rank):  # every rank's view of the call, in rank order
            for r, c in enumerate(ranks_calls):
                waits[number][r] += (last - c.start_us) / 1e3
    return comm, sizes, dtype_bytes, waits


def _optimizer_state_bytes(optimizer: str | None, sharded_total: int, missing: list[Missing],
                           estimated: list[str]) -> int:
    """The optimizer state, estimated from the optimizer's name (a trace holds no allocation of it); the estimate
    is noted in ``missing`` and ``estimated``."""
    state_factor = STATE_PER_PARAM_BYTE.get(optimizer or "", 2)
    estimated.append("optimizer_state_bytes")
    missing.append(Missing("optimizer state", f"{state_factor} x the sharded parameter bytes "
                           f"({optimizer or 'an unknown optimizer'})", "the predicted peak is off by any difference"))
    return state_factor * sharded_total


def _outside_ms(step: RankStep) -> float:
    """One rank's step less its modules' compute, its collectives as it spent them (waits included) and the
    optimizer, ms (a CPU step: one thread does all of it, so the parts sum to the step)."""
    parts = (sum(step.fwd_ms.values()) + sum(step.bwd_ms.values()) + sum(c.ms for c in step.collectives)
             + (step.optimizer_ms or 0.0))
    return max(0.0, step.step_ms - parts)


# [Note: A collective's figure is the mean of its calls]
# A step is the sum of its calls: per traced CPU step, each call's figure (compute and collectives the most of the
# ranks, the optimizer) sum to the step (`python -m bench.trace_profile --decompose DIR` checks it), the rest being
# work outside the modules (`TraceProfile.outside_ms`); the waits for a late rank are in
# those figures, as the late rank's work. But a CPU collective's time is heavy-tailed (a copy into memory the
# process has not touched yet is an order of magnitude dearer than one into memory it has), and every step draws
# a few tails, so the sum of the calls' medians falls below most steps while the sum of their means does not.
# The sum of the means is the mean of the sums; the sum of the medians is below most steps. Compute is not
# heavy-tailed, so it keeps the recorder's consolidation,
# the median.


def _collective_ms(calls: list[Collective], bare: bool = False) -> float:
    """One collective's time, ms, from every rank's view of it: each rank's transfer from the last rank's start
    (a rank that arrived first waited for it, which is skew, not the collective) to its own end, plus its copies
    around the transfer (:attr:`Collective.host_ms`); the most of the ranks. One rank alone: its own time. Clocks
    that disagree (a transfer would end before the last start, e.g. hosts out of sync): the least of the ranks'
    times. ``bare``: the call's own copy (:attr:`Collective.call_copy_ms`) in place of every copy around the
    transfer, what a bare call of the collective on preallocated buffers times."""
    def copies(c: Collective) -> float:
        return c.call_copy_ms if bare else c.host_ms

    if len(calls) == 1:
        return calls[0].ms - calls[0].host_ms + copies(calls[0])
    last = max(c.start_us for c in calls)
    if any(c.end_us < last for c in calls):
        return min(c.ms - c.host_ms + copies(c) for c in calls)
    return max(copies(c) + (c.end_us - last) / 1e3 for c in calls)


def _estimated_fingerprint(modules: tuple[str, ...], sizes: dict[tuple[str, str], int], world: int, device: str,
                           dtype_bytes: set[int]) -> Fingerprint:
    width = min(dtype_bytes) if dtype_bytes else 4
    param_bytes = tuple(sizes.get((m, "all_gather"), 0) for m in modules)
    return Fingerprint(module_fqns=modules, param_numels=tuple(b // width for b in param_bytes),
                       param_bytes=param_bytes, world_size=world, device_type=device,
                       param_dtypes=tuple(sorted({TORCH_DTYPE.get(w, "unknown") for w in dtype_bytes or {4}})),
                       torch_version="unknown (from a trace)")


def _peak(per_rank: dict[int, list[RankStep]], device: str, start_estimate: int, missing: list[Missing],
          estimated: list[str]) -> int | None:
    steps = [s for ss in per_rank.values() for s in ss]
    if any(s.peak_above_start_bytes is None for s in steps):
        missing.append(Missing("peak memory", "none", "record with profile_memory=True; a memory budget then "
                               "cannot be relative to the default's peak"))
        return None
    if device == "cuda":  # the caching allocator's total counts every tensor, the step's start included
        return int(_median_max([[s.start_bytes + s.peak_above_start_bytes for s in ss] for ss in per_rank.values()]))
    estimated.append("measured_peak_bytes")
    missing.append(Missing("bytes alive at step start (CPU)", "the sharded parameters and the estimated optimizer "
                           "state", "a CPU trace counts only what was allocated while profiling"))
    return start_estimate + int(_median_max([[s.peak_above_start_bytes for s in ss] for ss in per_rank.values()]))
