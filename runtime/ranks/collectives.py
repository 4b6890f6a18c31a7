"""The collectives the runtime's own protocol uses: rank 0's word to every rank, every rank's word to all, maxima.

A step's time is the slowest rank's (max across ranks), a figure of the
profile is the max across ranks of each rank's, and rank 0 alone decides
(plans, schedule blocks), so these few operations carry every exchange
between ranks outside the training step itself (docs/architecture.md,
"Measurement").
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from planner import errors
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


def from_rank0(compute: Callable[[], Any], group: dist.ProcessGroup | None = None) -> Any:
    """``compute()``, called on rank 0 alone, its result on every rank (collective: every rank calls it): what rank 0
    decides (a round's plans, a launch's rounds) and every rank acts on.

    Raises:
        PlannerError: ``compute`` raised one on rank 0: every rank raises its class and message; another
            exception there is named as rank 0's failure and raised as a ``PlannerError`` on every rank (rank 0
            too: a bug there must not leave its peers waiting).
    """
    payload: Any = None
    if dist.get_rank() == 0:
        try:
            payload = compute()
        except PlannerError as e:
            payload = _Raised(type(e).__name__, str(e))
        except Exception as e:  # noqa: BLE001 - raised on every rank below, named
            payload = _Raised("PlannerError", f"rank 0 failed: {one_line(e)}")
    payload = broadcast_from_rank0(payload, group)
    if isinstance(payload, _Raised):
        raise getattr(errors, payload.name, PlannerError)(payload.message)
    return payload


@dataclass(frozen=True)
class _Raised:
    """What :func:`from_rank0` sends for an exception on rank 0: its ``planner.errors`` class name and message."""

    name: str
    message: str


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
