"""FSDP2's all-gathers and reduce-scatters timed inside real steps, on the transfer's own clock, across ranks.

[Note: Collectives on NCCL's clock]
On a GPU the recorder reads each all-gather's and reduce-scatter's time from a Kineto trace of a few of FSDP2's
default steps (``runtime.recording.collective_trace``), not from a separate ``unshard()`` timed on the host: the
NCCL kernel FSDP2 launched inside its ``FSDP::all_gather`` or ``FSDP::post_backward_reduce`` label
(:mod:`planner.traces.fsdp_steps`), start to end on NCCL's own stream (CUPTI's kernel record, the GPU's clock). An
event on FSDP2's all-gather stream would time the wrong thing: ProcessGroupNCCL runs the kernel on a stream of its
own, which waits for the all-gather stream's copy-in. The kernel's time holds two parts:

- the transfer, which every rank's kernel spends alike once the last rank has joined;
- the wait for the late ranks: an NCCL kernel starts when its stream reaches it and spins until every peer's has
  started, so a rank that arrived early counts the others' lateness too.

A call's transfer is therefore the minimum of its kernel time across ranks (the last rank to arrive waited for
nobody), and each rank's wait is its kernel time less that minimum. :func:`in_step_collectives` takes, per module
and kind, the median over its calls of both: the transfer, and the wait averaged over the ranks. The simulator uses
the transfer (``ModuleProfile.all_gather_ms``, ``reduce_scatter_ms``), since a plan moves when a collective is
issued, not how late a rank is; the wait is recorded beside it (``all_gather_wait_ms``,
``reduce_scatter_wait_ms``), as the skew the step carries. On CPU the same rule reads gloo's work on its thread,
which spins for its peers the same way; the recorder keeps the isolated figures there (the CPU simulator's
overlap and communication scale are solved against them).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from planner.traces.fsdp_steps import RankStep

KINDS = ("all_gather", "reduce_scatter")


@dataclass(frozen=True)
class CollectiveCall:
    """One rank's view of one collective in one traced step: ``(step, module, kind, ordinal)`` pairs it with the
    other ranks' views; ``kernel_ms`` its transfer's own time, waiting for peers included, ms."""

    step: int
    module: str
    kind: str
    ordinal: int
    kernel_ms: float


@dataclass(frozen=True)
class InStepCollective:
    """One module's all-gather or reduce-scatter inside real steps ([Note: Collectives on NCCL's clock]).

    Attributes:
        transfer_ms: the median over its calls of the least kernel time across ranks.
        wait_ms: the median over its calls of the ranks' mean kernel time less that least (the wait for late
            ranks).
        calls: the calls every rank traced.
    """

    transfer_ms: float
    wait_ms: float
    calls: int


def rank_calls(steps: Sequence[RankStep]) -> list[CollectiveCall]:
    """One rank's collectives in its traced steps (:func:`planner.traces.fsdp_steps.rank_steps`)."""
    return [CollectiveCall(s.number, c.module, c.kind, c.ordinal, c.kernel_ms) for s in steps for c in s.collectives]


def in_step_collectives(per_rank: Sequence[Sequence[CollectiveCall]]) -> dict[tuple[str, str], InStepCollective]:
    """Per ``(module, kind)``, its collectives across ranks ([Note: Collectives on NCCL's clock]): a call counts
    where every rank traced it.

    Args:
        per_rank: each rank's :func:`rank_calls`, every rank's steps numbered alike.

    Raises:
        ValueError: no call was traced on every rank (no rank, or ranks whose steps never match).
    """
    views: dict[tuple[int, str, str, int], list[float]] = defaultdict(list)
    for calls in per_rank:
        for c in calls:
            views[(c.step, c.module, c.kind, c.ordinal)].append(c.kernel_ms)
    transfers: dict[tuple[str, str], list[float]] = defaultdict(list)
    waits: dict[tuple[str, str], list[float]] = defaultdict(list)
    for (_, module, kind, _), ms in views.items():
        if len(ms) != len(per_rank):
            continue
        least = min(ms)
        transfers[(module, kind)].append(least)
        waits[(module, kind)].append(statistics.fmean(ms) - least)
    if not transfers:
        raise ValueError(f"no collective was traced on all {len(per_rank)} ranks")
    return {key: InStepCollective(statistics.median(t), statistics.median(waits[key]), len(t))
            for key, t in transfers.items()}
