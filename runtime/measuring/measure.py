"""The workload's drivers of a measured round: the tune job's (:func:`measured_round`, the study's trials) and a
round of fixed plans (:func:`measure_plans`: a confirmation launch, ``confirm``, the benches), their steps the
workload's own training steps through the one step runner (``runtime.recording.steps.WorkloadSteps``).

Step ms for a plan is the median over measured steps of the max across ranks
(docs/architecture.md, "Measurement"). Plans are interleaved in one run so
that machine noise hits them alike; a schedule (``planner.statistics.schedule``)
decides the order, on rank 0.

The round itself (who asks, applies, checks the budget, schedules and fails
what) is :class:`runtime.measuring.round.MeasuredRound` ([Note: Rank protocol
of a measured round] there), the one the in-loop tuner drives with the user's
steps (``runtime.in_loop.round``). A step that raised is reported at the next
collective, and every rank raises :class:`planner.TrialFailedError`.

On a rank that died, Ctrl-C, SIGTERM or a storage error, the job
(``jobs.tune.TuneJob``) records every trial its session still holds FAIL
``FailKind.INTERRUPTED`` with the reason (``TuningSession.fail_held``: trials
created before the round was handed out too; ``runtime.ranks.interrupts`` holds
a signal back while rank 0 writes the study). SIGKILL leaves them RUNNING
until their heartbeat goes stale and the next job re-queues them
(``MeasuredStage.claim_retries``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from planner.artifacts.plan import Plan
from planner.statistics.schedule import Phase
from runtime.measuring.round import MeasuredRound, RoundStage, Scheduler, TrialT
from runtime.ranks.failures import FailureBoard
from runtime.ranks.interrupts import interrupts_deferred
from runtime.recording.steps import WorkloadSteps
from runtime.timing import WARMUP, RoundStep
from runtime.workload import Workload


class _OneBlock:
    """A :class:`Scheduler` that hands out one fixed block of rounds, then is done."""

    phase = Phase.RACE  # one block, nothing confirmed

    def __init__(self, block: list[list[int]]) -> None:
        self._block: list[list[int]] | None = block

    def next_block(self) -> list[list[int]] | None:
        block, self._block = self._block, None
        return block

    def record(self, block: list[dict[int, float]]) -> None:
        """Nothing to decide: :func:`measure_plans` returns the times."""


def measure_plans(runner: WorkloadSteps, rounds: Scheduler | list[list[int]] | None, warmup_steps: int = 0,
                  on_step: Callable[[], None] | None = None) -> list[list[float]]:
    """Every rank: each of the runner's plans warmed up in turn (``warmup_steps`` untimed steps each), then its
    rounds: a :class:`~runtime.measuring.round.MeasuredRound` of these fixed plans with no study, each block's
    alignment on the runner's group (a confirmation launch, ``confirm``, the benches).

    Args:
        rounds: one fixed block of rounds (per round, the plan indices in running order; every rank the same), or
            rank 0's scheduler (``planner.statistics.schedule.Schedule``; ``None`` on the other ranks), whose blocks
            run until it says it is done.
        on_step: progress callback per step.

    Returns:
        Per plan, each of its timed steps' max across ranks, ms.

    Raises:
        StepFailed: a warm-up step raised (names the plan).
        PlannerError: rank 0's scheduler raised (every rank raises it).
        TrialFailedError: a timed step raised on a rank, or a rank did not report.
    """
    for index in range(len(runner.side.plans)):
        for _ in range(warmup_steps):
            runner.run_all([RoundStep(WARMUP, index)])
            if on_step is not None:
                on_step()
    if isinstance(rounds, list):
        rounds = _OneBlock(rounds) if dist.get_rank() == 0 else None
    round_ = MeasuredRound.of_plans(runner.side.plans, runner.side.group)
    todo = round_.begin(lambda: rounds)
    while todo is not None:
        todo = round_.record(*runner.run(todo, round_.peaks, on_step))
    return round_.step_ms


@dataclass(frozen=True)
class RoundResult:
    """What a measured round left: measured plans (rank 0 only) and failed trial numbers."""

    plans_measured: list[Plan]
    failed: dict[int, str]


def measured_round(
    workload: Workload,
    stage: RoundStage[TrialT] | None,
    warmup_steps: int,
    group: dist.ProcessGroup,
    on_step: Callable[[], None] | None = None,
    on_warm_up: Callable[[int], None] | None = None,
    board: FailureBoard | None = None,
) -> RoundResult:
    """One measured round on every rank, its steps run as training steps of ``workload``.

    Args:
        workload: this rank's workload.
        stage: rank 0: the study's side of the round (its ``prepare`` is the round's first step);
            ``None`` on other ranks.
        warmup_steps: untimed steps per plan before the first block.
        group: the control group (``runtime.ranks.collectives.control_group``).
        on_step: progress callback per step.
        on_warm_up: progress callback, called once before the warm-up with its steps (every plan that applied
            everywhere, ``runtime.measuring.round.warm_up_steps``).
        board: the job's failure board (``runtime.ranks.failures``): a step that raised is agreed on there, and the
            ranks go on without its plan where they can ([Note: A failed step on some ranks]).

    Returns:
        :class:`RoundResult` (``plans_measured`` empty on ranks other than 0, and when the baseline failed to
        apply).

    Raises:
        PlannerError: rank 0 could not ask the study (bad storage, ...) or
            could not go on with the schedule.
        TrialFailedError: a rank raised inside a step (the round's trials
            are recorded FAIL first), or a rank did not report (the caller
            fails them: ``TuningSession.fail_held``).
    """
    round_ = MeasuredRound(group, stage, warmup_steps, board)
    round_.ask()
    todo = round_.apply_everywhere(workload.model)
    if todo is None:  # the baseline (FSDP2's default, or the plan the model arrived with): nothing to compare with
        return RoundResult([], round_.failed_trials())
    if on_warm_up is not None:
        on_warm_up(len(todo))
    runner = WorkloadSteps(workload, round_.plans, group, applied=0, board=board)  # apply_everywhere: the baseline
    _, failure = runner.run(todo, round_.peaks, on_step)
    todo = round_.start(failure)
    while todo is not None:
        todo = round_.record(*runner.run(todo, round_.peaks, on_step))
    if not round_.rank0:
        return RoundResult([], {})
    with interrupts_deferred():  # a Ctrl-C during the writes waits until every trial is told
        plans_measured = round_.tell()
    return RoundResult(plans_measured, round_.failed_trials())
