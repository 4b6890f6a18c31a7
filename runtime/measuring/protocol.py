"""The tune job's driver of a measured round: every rank runs the round's steps as training steps of its workload.

The round itself (who asks, applies, checks the budget, schedules and fails
what) is :class:`runtime.measuring.round.MeasuredRound` ([Note: Rank protocol
of a measured round] there), the one the in-loop tuner drives with the user's
steps (``runtime.in_loop.round``). Here the job's own loop runs its steps
(``runtime.measuring.measure.run_steps``) and reports each stretch to it; a
step that raised is reported at the next collective, and every rank raises
:class:`planner.TrialFailedError`.

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
from runtime.measuring.measure import run_steps
from runtime.measuring.round import MeasuredRound, RoundStage, TrialT
from runtime.ranks.interrupts import interrupts_deferred
from runtime.timing import StepCounter
from runtime.workload import Workload


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
    round_ = MeasuredRound(group, stage, warmup_steps)
    round_.ask()
    todo = round_.apply_everywhere(workload.model)
    if todo is None:  # the baseline (FSDP2's default, or the plan the model arrived with): nothing to compare with
        return RoundResult([], round_.failed_trials())
    if on_warm_up is not None:
        on_warm_up(len(todo))
    counter = StepCounter()
    _, failure = run_steps(workload, round_, todo, counter, on_step)
    todo = round_.start(failure)
    while todo is not None:
        todo = round_.record(*run_steps(workload, round_, todo, counter, on_step))
    if not round_.rank0:
        return RoundResult([], {})
    with interrupts_deferred():  # a Ctrl-C during the writes waits until every trial is told
        plans_measured = round_.tell()
    return RoundResult(plans_measured, round_.failed_trials())
