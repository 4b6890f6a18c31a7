"""All-gather and reduce-scatter times per FSDP module, measured in isolation with every rank together."""

from __future__ import annotations

import dataclasses
import functools
import statistics

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.rank_measurements import CollectiveMeasurements, OverlapTimings
from runtime.ranks.device import device_of
from runtime.ranks.torch_private import collective_dtypes, data_parallel_groups
from runtime.recording.overlap_timer import overlap_timings
from runtime.workload import own_parameters

# [Note: Collectives timed in rounds]
# The machine's speed drifts within a recording: a slow stretch of a few seconds that lands on the repeats of a few
# modules, timed one module after another, reads those modules far above identical ones. A plan search reads per-module
# figures, so a stretch that lands on a few modules makes them look dear to prefetch. The collectives are
# therefore timed in rounds: each round times every module's all-gather and then its reduce-scatter, and the next
# round starts one module later, so a slow stretch costs one repeat of several modules rather than every repeat of
# a few. A median drops that repeat only with 3 or more of them, so the collectives take at least
# ``COLLECTIVE_ROUNDS`` (docs/decisions/collectives-in-rounds.md). The same order runs on every rank (the collectives
# must match).
COLLECTIVE_ROUNDS = 5




def process_groups(modules: list[tuple[str, FSDPModule]]) -> tuple[dist.ProcessGroup | None,
                                                                    dist.ProcessGroup | None]:
    """The shard group FSDP2 all-gathers and reduce-scatters over, and HSDP's replicate group it all-reduces over
    (``None``: FSDP), from FSDP2's own mesh info (``torch_private.data_parallel_groups``): under FSDP + TP the dp
    sub-mesh's group, never the parameters' (dp, tp) DTensor mesh. ``None`` for the shard group: the default group
    (no module manages a parameter)."""
    for _, module in modules:
        groups = data_parallel_groups(module)
        if groups is not None:
            return groups
    return None, None


def collective_rounds(modules: list[tuple[str, FSDPModule]], unsharded_numels: dict[str, int], repeats: int,
                      device: str) -> dict[str, dict[str, float]]:
    """Per module of ``unsharded_numels``: the median all-gather and reduce-scatter in ms, timed in rounds.

    Every rank calls this together. Round ``r`` of ``repeats + 1`` (the first warms up and is dropped) times, for
    each module from the ``r``-th on, wrapping around ([Note: Collectives timed in rounds]):

    - one ``module.unshard()`` (all-gather and copy-out, FSDP2's ``FSDPParamGroup.unshard`` and
      ``wait_for_unshard``), then ``module.reshard()`` untimed;
    - one reduce-scatter of a gradient of the module's unsharded elements in the dtype of its own parameters,
      padded to a multiple of the shard group's size as FSDP2 pads, over the shard group, into a preallocated output
      (the buffers of one size are shared by the modules of that size); under HSDP then the all-reduce of that
      output over the replicate group, as ``foreach_reduce`` runs them: the figure is both
      ([Note: HSDP's all-reduce] in ``planner.simulation.link``).

    Args:
        modules: the FSDP modules, ``(fqn, module)``, all resharded.
        unsharded_numels: the modules to time, ``fqn -> unsharded parameter elements``, the same on every rank
            and in the same order.
        repeats: timed rounds (at least 1).
        device: ``"cpu"`` or ``"cuda"``.

    Returns:
        Per FQN, its all-gather and reduce-scatter ms, medians over the rounds (``sharded_bytes`` left 0).
    """
    shard_group, replicate_group = process_groups(modules)
    world = dist.get_world_size(shard_group)
    by_fqn = dict(modules)
    fqns = list(unsharded_numels)
    # reduce_scatter_single replaces the deprecated reduce_scatter_tensor in newer torch
    reduce_scatter_op = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def reduce_scatter(out: torch.Tensor, inp: torch.Tensor) -> None:  # foreach_reduce's collectives, in turn
        reduce_scatter_op(out, inp, group=shard_group)
        if replicate_group is not None:
            dist.all_reduce(out, group=replicate_group)

    buffers: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
    sizes = {}  # fqn -> (padded elements, dtype) of its reduce-scatter's input: the gradient at reduce_dtype
    for fqn in fqns:
        own = own_parameters(modules, fqn)
        moved = collective_dtypes(by_fqn[fqn])
        dtype = moved.reduce_scatter if moved is not None else own[0].dtype if own else torch.float32
        sizes[fqn] = (-(-unsharded_numels[fqn] // world) * world, dtype)
    timed = device_of(device).timed_ms
    all_gathers: dict[str, list[float]] = {fqn: [] for fqn in fqns}
    reduce_scatters: dict[str, list[float]] = {fqn: [] for fqn in fqns}
    for r in range(repeats + 1):
        for k in range(len(fqns)):
            fqn = fqns[(r + k) % len(fqns)]
            module = by_fqn[fqn]
            all_gather = timed(module.unshard)
            module.reshard()
            if sizes[fqn] not in buffers:
                padded, dtype = sizes[fqn]
                buffers[sizes[fqn]] = (torch.zeros(padded, dtype=dtype, device=device),
                                       torch.empty(padded // world, dtype=dtype, device=device))
            inp, out = buffers[sizes[fqn]]
            reduce_scatter_time = timed(functools.partial(reduce_scatter, out, inp))
            if r:
                all_gathers[fqn].append(all_gather)
                reduce_scatters[fqn].append(reduce_scatter_time)
    return {fqn: CollectiveMeasurements(statistics.median(all_gathers[fqn]), statistics.median(reduce_scatters[fqn]))
            for fqn in fqns}


def module_collectives(modules: list[tuple[str, FSDPModule]], fingerprint: Fingerprint, repeats: int,
                       device: str) -> tuple[dict[str, CollectiveMeasurements], OverlapTimings | None]:
    """Every FSDP module's collectives in isolation, and on a CPU device the overlap microbenchmark (all ranks).

    In order: every module's all-gather and reduce-scatter in ``max(repeats, COLLECTIVE_ROUNDS)`` rounds
    (:func:`collective_rounds`), then the overlap microbenchmark
    (:func:`runtime.recording.overlap_timer.overlap_timings`,
    sized by those all-gathers; ``None`` on CUDA).

    Returns:
        Per FQN its figures (``sharded_bytes``: this rank's bytes of the module's own parameter shards), and the
        overlap timings or ``None``.
    """
    numels = dict(zip(fingerprint.module_fqns, fingerprint.param_numels, strict=True))
    figures = collective_rounds(modules, numels, max(repeats, COLLECTIVE_ROUNDS), device)
    ag_ms = {fqn: values.all_gather_ms for fqn, values in figures.items()}
    overlap = overlap_timings(modules, numels, ag_ms, max(repeats, 10)) if device != "cuda" else None
    return {fqn: dataclasses.replace(values, sharded_bytes=sum(p.to_local().numel() * p.element_size()
                                                                for p in own_parameters(modules, fqn)))
            for fqn, values in figures.items()}, overlap
