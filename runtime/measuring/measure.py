"""Timing real training steps: one step, several plans interleaved, and the blocks of a schedule on every rank.

Step ms for a plan is the median over measured steps of the max across ranks
(docs/architecture.md, "Measurement"). Plans are interleaved in one run so
that machine noise hits them alike; a schedule (``planner.statistics.schedule``)
decides the order, on rank 0 (:func:`run_schedule`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.distributed as dist

from planner.artifacts.plan import Plan
from planner.statistics.schedule import Phase
from runtime.apply import configure_plan
from runtime.measuring.round import PEAK, TIMED, MeasuredRound, RoundStep, Scheduler, StepFailure
from runtime.ranks.device import device_of
from runtime.recording.peak_memory import measure_peak
from runtime.timing import StepCounter, StepFailed, device_type_of
from runtime.workload import Workload, train_step


def timed_step(workload: Workload, step: int) -> float:
    """Run one training step after a barrier; return this rank's wall time in ms (``Device.timed_ms``)."""
    return device_of(device_type_of(workload)).timed_ms(lambda: train_step(workload, step))


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
            configure_plan(workload.model, plan, check=False)
            for _ in range(warmup_steps):
                train_step(workload, steps.next())
                if on_step is not None:
                    on_step()
    except Exception as e:
        raise StepFailed(index, e) from e


def run_steps(
    workload: Workload,
    round_: MeasuredRound,
    steps: Sequence[RoundStep],
    counter: StepCounter,
    on_step: Callable[[], None] | None = None,
) -> tuple[list[float], StepFailure | None]:
    """Run ``steps`` as training steps of ``workload`` (all ranks call this with the same steps): each step's plan
    switched in first, a peak step's peak appended to ``round_.peaks``, a timed step timed (:func:`timed_step`).

    Returns:
        This rank's timed steps' ms, in step order, and the step that raised (``None``: none did; the steps after
        it did not run).
    """
    times: list[float] = []
    applied = None
    for step in steps:
        try:
            if step.plan != applied:
                configure_plan(workload.model, round_.plans[step.plan], check=False)
                applied = step.plan
            if step.kind == PEAK:
                round_.peaks[step.plan].append(measure_peak(workload, counter.next()).peak_bytes)
            elif step.kind == TIMED:
                times.append(timed_step(workload, counter.next()))
            else:
                train_step(workload, counter.next())
        except Exception as e:  # noqa: BLE001 - reported at the round's next collective, where the cause is named
            return times, StepFailure.of(step.plan, e)
        if on_step is not None:
            on_step()
    return times, None


class OneBlock:
    """A :class:`Scheduler` that hands out one fixed block of rounds, then is done (what a bench measures)."""

    def __init__(self, block: list[list[int]]) -> None:
        self._block: list[list[int]] | None = block

    def next_block(self) -> list[list[int]] | None:
        block, self._block = self._block, None
        return block

    @property
    def phase(self) -> Phase:
        """Always the race: one block, nothing confirmed."""
        return Phase.RACE

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
        Per plan, each of its steps' max across ranks, ms.

    Raises:
        TrialFailedError: a step raised on a rank, or a rank did not report.
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
        ``step_ms[i]``: plan ``i``'s step times, max across ranks, ms.
    """
    steps = StepCounter()
    warm_up(workload, plans, warmup_steps, steps, on_step)
    return measure_rounds(workload, plans, [list(range(len(plans)))] * rounds, steps, on_step=on_step)


def run_schedule(
    workload: Workload,
    plans: Sequence[Plan],
    scheduler: Scheduler | None,
    counter: StepCounter,
    group: dist.ProcessGroup | None = None,
    on_step: Callable[[], None] | None = None,
) -> tuple[list[list[float]], list[list[list[float]]]]:
    """Every rank: run the blocks of rounds rank 0's ``scheduler`` hands out over fixed ``plans`` (warmed up before),
    until it says it is done: a :class:`~runtime.measuring.round.MeasuredRound` of these plans with no study.

    Args:
        scheduler: rank 0's (``planner.statistics.schedule.Schedule``); ``None`` on the other ranks.
        group: the group of the round's collectives (``runtime.ranks.collectives.control_group``).

    Returns:
        Per plan: every step's max across ranks, ms, and per rank that rank's own times, ms.

    Raises:
        PlannerError: rank 0's scheduler raised (every rank raises it).
        TrialFailedError: a step raised on a rank, or a rank did not report.
    """
    round_ = MeasuredRound.of_plans(plans, group)
    todo = round_.begin(lambda: scheduler)
    while todo is not None:
        todo = round_.record(*run_steps(workload, round_, todo, counter, on_step))
    return round_.step_ms, round_.per_rank
