"""All-gather and reduce-scatter times per FSDP module, measured in isolation with every rank together."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from planner.artifacts.fingerprint import Fingerprint
from runtime.measure import synchronize
from runtime.overlap_timer import overlap_timings
from runtime.workload import own_parameters


def _median_ms(run: Callable[[], None], after: Callable[[], None], repeats: int, device: str) -> float:
    """Median wall time of ``run`` in ms over ``repeats`` (one extra warm-up dropped), each after a barrier."""
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        synchronize(device)
        t0 = time.perf_counter()
        run()
        synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
        after()
    return statistics.median(times[1:])


def all_gather_ms(modules: list[tuple[str, FSDPModule]], repeats: int, device: str) -> dict[str, float]:
    """Per FSDP module: one ``module.unshard()`` (all-gather + copy-out) after a barrier, ms (median)."""
    return {fqn: _median_ms(m.unshard, m.reshard, repeats, device) for fqn, m in modules}


def reduce_scatter_ms(numel: int, dtype: torch.dtype, repeats: int, device: str) -> float:
    """One reduce-scatter of a gradient of ``numel`` elements of ``dtype`` (padded as FSDP2 pads), ms (median)."""
    world = dist.get_world_size()
    padded = -(-numel // world) * world
    inp = torch.zeros(padded, dtype=dtype, device=device)
    out = torch.empty(padded // world, dtype=dtype, device=device)
    # reduce_scatter_single replaces the deprecated reduce_scatter_tensor in newer torch
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return _median_ms(lambda: reduce_scatter(out, inp), lambda: None, repeats, device)


def module_collectives(modules: list[tuple[str, FSDPModule]], fingerprint: Fingerprint, repeats: int,
                       device: str) -> tuple[dict[str, dict[str, float]], dict[str, float | str] | None]:
    """Every FSDP module's collectives in isolation, and on a CPU device the overlap microbenchmark (all ranks).

    In order: every module's all-gather (:func:`all_gather_ms`), the overlap microbenchmark
    (:func:`runtime.overlap_timer.overlap_timings`, sized by those all-gathers; ``None`` on CUDA), every module's
    reduce-scatter of a gradient of its unsharded parameters' elements and dtype (:func:`reduce_scatter_ms`).

    Returns:
        ``({fqn: {"all_gather_ms", "reduce_scatter_ms", "sharded_bytes"}}, overlap timings or None)``: ms, and
        this rank's bytes of the module's own parameter shards.
    """
    ag_ms = all_gather_ms(modules, repeats, device)
    numels = dict(zip(fingerprint.module_fqns, fingerprint.param_numels, strict=True))
    overlap = overlap_timings(modules, numels, ag_ms, max(repeats, 10)) if device != "cuda" else None
    figures = {}
    for fqn, numel in numels.items():
        own = own_parameters(modules, fqn)
        figures[fqn] = {
            "all_gather_ms": ag_ms[fqn],
            "reduce_scatter_ms": reduce_scatter_ms(numel, own[0].dtype if own else torch.float32, repeats, device),
            "sharded_bytes": sum(p.to_local().numel() * p.element_size() for p in own),
        }
    return figures, overlap
