"""Per-rank recorder figures into one Profile: the passes of one rank merged (:func:`merge_isolated`), then every
rank's consolidated (:func:`consolidate`: max across ranks, as the recorder's module docstring says)."""

from __future__ import annotations

import statistics
from typing import Any

from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.profile import InStepTimings, ModuleProfile, OverlapTimings, Profile, backward_temporaries
from runtime.peak_memory import peak_of_steps


def merge_isolated(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One rank's :func:`isolated_figures` from passes of a few modules each: each module's figures from the parts
    that hold them; orders and forward calls from the first part (the same in every pass); the overlap
    microbenchmark from the part that ran it.

    Raises:
        ValueError: the parts disagree on the post-forward order.
    """
    merged = {**parts[0], "modules": {}}
    for part in parts:
        if part["post_forward_order"] != merged["post_forward_order"]:
            raise ValueError(f"the isolated passes disagree on the post-forward order: {merged['post_forward_order']}"
                             f" then {part['post_forward_order']}")
        merged["overlap"] = merged["overlap"] or part["overlap"]
        for fqn, figures in part["modules"].items():
            merged["modules"].setdefault(fqn, {}).update(figures)
    return merged


def consolidate(per_rank: list[dict], fingerprint: Fingerprint, raf: dict[str, bool], calls: dict[str, int],
                microbatches: int = 1) -> Profile:
    """The profile from every rank's figures (``record_profile``'s ``local``, gathered): max across ranks of every
    figure; orders must agree across ranks.

    Raises:
        RuntimeError: the ranks disagree on the post-forward order.
    """
    first = per_rank[0]
    for other in per_rank[1:]:
        if other["post_forward_order"] != first["post_forward_order"]:
            raise RuntimeError(f"ranks disagree on the post-forward order: rank 0 {first['post_forward_order']}, "
                               f"rank {other['rank']} {other['post_forward_order']}")
    unsharded = dict(zip(fingerprint.module_fqns, fingerprint.param_bytes, strict=True))
    modules = {}
    for fqn in fingerprint.module_fqns:
        figures = {k: max(r["modules"][fqn][k] for r in per_rank) for k in first["modules"][fqn]}
        modules[fqn] = ModuleProfile(
            fqn=fqn,
            fwd_ms=figures["fwd_ms"],
            bwd_ms=figures["bwd_ms"],
            fwd_pre_ms=min(figures["fwd_pre_ms"], figures["fwd_ms"]),
            bwd_pre_ms=min(figures["bwd_pre_ms"], figures["bwd_ms"]),
            all_gather_ms=figures["all_gather_ms"],
            reduce_scatter_ms=figures["reduce_scatter_ms"],
            unsharded_bytes=unsharded[fqn],
            sharded_bytes=int(figures["sharded_bytes"]),
            grad_bytes=unsharded[fqn],
            activation_bytes=int(figures["activation_bytes"]),
            reshard_after_forward=raf[fqn],
            needs_parameters_in_backward=bool(figures["needs_parameters_in_backward"]),  # any rank: max
            recompute_ms=figures.get("recompute_ms", 0.0),
            recompute_activation_bytes=int(figures.get("recompute_activation_bytes", 0)),
            # the root's gradient before its children's backward (the LM head's), measured; the rest after
            backward_post_grad_bytes=max(0, unsharded[fqn] - int(figures.get("grad_pre_bytes", unsharded[fqn]))),
            # the root's saved bytes after its children's forward, freed before their backward
            activation_post_bytes=min(int(figures["activation_bytes"]), int(figures.get("activation_post_bytes", 0))),
            backward_temp_bytes=backward_temporaries(figures.get("backward_peak_bytes", 0),
                                                     min(unsharded[fqn], figures.get("grad_pre_bytes", unsharded[fqn])),
                                                     figures.get("recompute_activation_bytes", 0)),
            calls=max(1, calls.get(fqn, 1)),
        )
    root = fingerprint.module_fqns[0]
    overlap = None
    if first["overlap"] is not None:
        overlap = OverlapTimings(first["overlap"]["module"],
                                 **{k: statistics.fmean(r["overlap"][k] for r in per_rank)
                                    for k in ("all_gather_ms", "compute_ms", "overlapped_ms")})
    step_ms = max(r["step_ms"] for r in per_rank)
    ratios = [r["async_ratio"] for r in per_rank if r.get("async_ratio") is not None]
    async_step_ms = step_ms * max(ratios) if ratios else None
    return Profile(
        fingerprint=fingerprint,
        pre_forward_order=(root, *first["pre_forward_order"]),
        post_forward_order=(*first["post_forward_order"], root),
        modules=modules,
        optimizer_ms=max(r["optimizer_ms"] for r in per_rank),
        optimizer_state_bytes=max(r["optimizer_state_bytes"] for r in per_rank),
        measured_step_ms=step_ms,
        optimizer_temp_bytes=max(r["optimizer_temp_bytes"] for r in per_rank),
        measured_peak_bytes=peak_of_steps([r["peak_bytes"] for r in per_rank]),
        microbatches=microbatches,
        per_rank=per_rank,
        consolidation="max",
        in_step=InStepTimings(default_step_ms=step_ms, overlap=overlap, async_default_step_ms=async_step_ms,
                              allocator=first.get("allocator"),
                              default_step_faults=_max_of(per_rank, "step_faults"),
                              default_step_kernel_ms=_max_of(per_rank, "step_kernel_ms")),
    )


def _max_of(per_rank: list[dict[str, Any]], key: str) -> Any:
    """The max across ranks of ``key``; ``None`` where a rank did not measure it (the in-loop recorder)."""
    values = [r.get(key) for r in per_rank]
    return None if any(v is None for v in values) else max(values)
