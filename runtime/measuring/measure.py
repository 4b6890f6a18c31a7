"""Timing real training steps: one step, several plans interleaved, and the blocks of a schedule on every rank.

Step ms for a plan is the median over measured steps of the max across ranks
(docs/architecture.md, "Measurement"). Plans are interleaved in one run so
that machine noise hits them alike; a schedule (``planner.statistics.schedule``)
decides the order, on rank 0 (:func:`run_schedule`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch.distributed as dist

from planner.artifacts.plan import Plan
from planner.errors import PlannerError, one_line
from runtime.apply import apply_plan
from runtime.ranks.collectives import broadcast_from_rank0, gather_objects, max_across_ranks
from runtime.timing import StepCounter, StepFailed, device_type_of, timed_ms
from runtime.workload import Workload, train_step


class Scheduler(Protocol):
    """Rank 0's schedule of a round's steps (``planner.statistics.schedule.Schedule``)."""

    def next_block(self) -> list[list[int]] | None:
        """The next rounds (plan indices in running order), ``None`` when done."""

    def record(self, block: list[dict[int, float]]) -> None:
        """The block's step times: per round, plan index -> ms (max across ranks)."""


# How a block's step times reach every rank: given this rank's run, every rank's result (gather_objects by default).
Report = Callable[[Callable[[], list[list[float]]]], list[list[list[float]]]]


def timed_step(workload: Workload, step: int) -> float:
    """Run one training step after a barrier; return this rank's wall time in ms (:func:`timed_ms`)."""
    return timed_ms(lambda: train_step(workload, step), device_type_of(workload))


def warm_up(
    workload: Workload,
    plans: Sequence[Plan],
    warmup_steps: int,
    steps: StepCounter,
    on_step: Callable[[], None] | None = None,
) -> None:
    """Apply each plan (checked before) and run ``warmup_steps`` untimed steps with it.

    Raises:
        StepFailed: a step raised; names the plan.
    """
    index = 0
    try:
        for index, plan in enumerate(plans):  # noqa: B007 - the except clause names the plan by its index
            apply_plan(workload.model, plan, check=False)
            for _ in range(warmup_steps):
                train_step(workload, steps.next())
                if on_step is not None:
                    on_step()
    except Exception as e:
        raise StepFailed(index, e) from e


def run_block(
    workload: Workload,
    plans: Sequence[Plan],
    block: list[list[int]],
    steps: StepCounter,
    on_step: Callable[[], None] | None = None,
) -> list[list[float]]:
    """This rank's step times of a block of rounds (all ranks call this with the same block).

    Args:
        plans: the plans, indexed by the block.
        block: per round, the plan indices in running order; each step applies
            its plan first (a plan's settings are switched between steps).

    Returns:
        Per round, per position, this rank's step time, ms.

    Raises:
        StepFailed: a step raised; names the plan.
    """
    out = []
    index = 0
    try:
        for order in block:
            times = []
            for index in order:
                apply_plan(workload.model, plans[index], check=False)
                times.append(timed_step(workload, steps.next()))
                if on_step is not None:
                    on_step()
            out.append(times)
    except Exception as e:
        raise StepFailed(index, e) from e
    return out


class OneBlock:
    """A :class:`Scheduler` that hands out one fixed block of rounds, then is done (what a bench measures)."""

    def __init__(self, block: list[list[int]]) -> None:
        self._block: list[list[int]] | None = block

    def next_block(self) -> list[list[int]] | None:
        block, self._block = self._block, None
        return block

    def record(self, block: list[dict[int, float]]) -> None:
        """Nothing to decide: :func:`run_schedule` returns the times."""


def measure_rounds(
    workload: Workload,
    plans: Sequence[Plan],
    block: list[list[int]],
    steps: StepCounter,
    group: dist.ProcessGroup | None = None,
    on_step: Callable[[], None] | None = None,
) -> list[list[float]]:
    """Every rank: one fixed block of rounds (per round, the plan indices in running order), through
    :func:`run_schedule`, the study's own measured round.

    Returns:
        On rank 0, per plan, each of its steps' max across ranks, ms; on the other ranks, empty lists.

    Raises:
        StepFailed: a step raised on this rank.
        TrialFailedError: a rank did not report.
    """
    scheduler = OneBlock(block) if dist.get_rank() == 0 else None
    step_ms, _ = run_schedule(workload, plans, scheduler, steps, group, on_step)
    return step_ms


def measure_plans(
    workload: Workload,
    plans: Sequence[Plan],
    rounds: int,
    warmup_steps: int = 1,
    on_step: Callable[[], None] | None = None,
) -> list[list[float]]:
    """Every rank: warm each plan up (:func:`warm_up`), then ``rounds`` rounds A B C ... (:func:`measure_rounds`).

    Returns:
        On rank 0, ``step_ms[i]``: plan ``i``'s step times, max across ranks, ms; on the other ranks, empty lists.
    """
    steps = StepCounter()
    warm_up(workload, plans, warmup_steps, steps, on_step)
    return measure_rounds(workload, plans, [list(range(len(plans)))] * rounds, steps, on_step=on_step)


def run_schedule(
    workload: Workload,
    plans: Sequence[Plan],
    scheduler: Scheduler | None,
    steps: StepCounter,
    group: dist.ProcessGroup | None = None,
    on_step: Callable[[], None] | None = None,
    report: Report | None = None,
) -> tuple[list[list[float]], list[list[list[float]]]]:
    """Every rank: run the blocks of rounds rank 0's ``scheduler`` hands out, until it says it is done.

    Rank 0 asks the scheduler for a block and broadcasts it; every rank runs
    it (:func:`run_block`, plans applied before each step, warmed up before);
    rank 0 feeds the scheduler each step's max across ranks.

    Args:
        scheduler: rank 0's (``planner.statistics.schedule.Schedule``); ``None`` on the other ranks.
        group: the group of the protocol's collectives (``runtime.ranks.collectives.control_group``).
        report: how a block's step times reach every rank, given this rank's run of it (default: run it and
            gather the times); the rank protocol's also turns a failed step on any rank into a failed trial.

    Returns:
        On rank 0, per plan: every step's max across ranks, ms, and per rank that rank's own times, ms; on the
        other ranks, empty lists.

    Raises:
        PlannerError: rank 0's scheduler raised (every rank raises it).
        StepFailed: a step raised on this rank (with the default ``report``).
        TrialFailedError: a rank did not report.
    """
    rank0, world = dist.get_rank() == 0, dist.get_world_size()
    step_ms: list[list[float]] = [[] for _ in plans]
    per_rank: list[list[list[float]]] = [[[] for _ in range(world)] for _ in plans]
    while True:
        payload: Any = None
        if rank0:
            try:
                payload = scheduler.next_block()
            except PlannerError as e:  # every rank must hear that rank 0 cannot go on
                payload = {"error": str(e)}
            except Exception as e:  # noqa: BLE001 - the same for a bug in the schedule
                payload = {"error": f"the measured round's schedule failed: {one_line(e)}"}
        block = broadcast_from_rank0(payload, group)
        if block is None:
            break

        def run(block: list[list[int]] = block) -> list[list[float]]:
            return run_block(workload, plans, block, steps, on_step)

        reports = report(run) if report is not None else gather_objects(run(), group)
        if rank0:
            maxed = []
            for k, order in enumerate(block):
                times = max_across_ranks([rep[k] for rep in reports])
                maxed.append(dict(zip(order, times, strict=True)))
                for pos, j in enumerate(order):
                    step_ms[j].append(times[pos])
                    for r, rep in enumerate(reports):
                        per_rank[j][r].append(rep[k][pos])
            scheduler.record(maxed)
    return step_ms, per_rank
