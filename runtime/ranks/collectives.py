"""The collectives the runtime's own protocol uses: rank 0's word to every rank, every rank's word to all, maxima.

A step's time is the slowest rank's (max across ranks), a figure of the
profile is the max across ranks of each rank's, and rank 0 alone decides
(plans, schedule blocks), so these few operations carry every exchange
between ranks outside the training step itself (docs/architecture.md,
"Measurement").
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from planner.artifacts.plan import Plan
from planner.errors import PlannerError, TrialFailedError, one_line


def control_timeout_s(timeout_s: float) -> float:
    """The control group's timeout for a process-group timeout of ``timeout_s``, in s: long enough for a rank that
    failed early to wait while its peers time out in a training collective, short enough that no rank waits for ever."""
    return 2 * timeout_s + 60


def control_group(timeout_s: float) -> dist.ProcessGroup:
    """A gloo group over every rank for the protocol's collectives, apart from training's (all ranks call this)."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=control_timeout_s(timeout_s)))


def broadcast_from_rank0(payload: Any, group: dist.ProcessGroup | None = None) -> Any:
    """Rank 0's ``payload`` on every rank (``broadcast_object_list``); ``{"error": msg}`` raises on every rank.

    Raises:
        PlannerError: rank 0 sent ``{"error": msg}`` (the message is ``msg``).
    """
    box = [payload]
    dist.broadcast_object_list(box, src=0, group=group)
    if isinstance(box[0], dict) and "error" in box[0]:
        raise PlannerError(box[0]["error"])
    return box[0]


def broadcast_plans(plans: Sequence[Plan] | PlannerError | None, group: dist.ProcessGroup | None = None) -> list[Plan]:
    """Rank 0's plans on every rank (``plans`` on rank 0, ``None`` elsewhere); an error on rank 0 raises everywhere.

    Raises:
        PlannerError: rank 0 passed one (its message).
    """
    if isinstance(plans, PlannerError):
        payload: Any = {"error": str(plans)}
    else:
        payload = [p.to_dict() for p in plans] if plans is not None else None
    return [Plan.from_dict(d) for d in broadcast_from_rank0(payload, group)]


def gather_objects(local: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``local``, by rank (``all_gather_object``).

    Raises:
        TrialFailedError: a rank did not report (it died, or it is stuck past the group's timeout).
    """
    out: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(out, local, group=group)
    except Exception as e:  # noqa: BLE001 - gloo reports a dead peer in several ways
        raise TrialFailedError(f"a rank did not report to rank {dist.get_rank()}: {one_line(e)}", local=True) from None
    return out


def max_across_ranks(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Element by element, the largest of the ranks' figures: ``per_rank[r][i]`` -> ``max over r``."""
    return [max(values) for values in zip(*per_rank, strict=True)]


def gather_max(local: Sequence[float], group: dist.ProcessGroup | None = None) -> tuple[list[float], list[list[float]]]:
    """Every rank's per-step figures, and their max across ranks (all ranks call this).

    Returns:
        ``(max across ranks per step, per-rank lists)``.

    Raises:
        TrialFailedError: a rank did not report.
    """
    gathered = gather_objects(list(local), group)
    return max_across_ranks(gathered), gathered
