"""The rank protocol of a measured round: who talks to the study, who waits for whom, for how long.

[Note: Rank protocol of a measured round]
Every rank runs :func:`measured_round` with the same arguments; rank 0 alone
holds the study (a :class:`RoundStage`: ``planner.study.session.TuningSession``).

1. Plans. Rank 0 asks the study for the round's trials (the baseline
   first, then re-queued plans of dead jobs, then the best simulated plans
   not yet measured) and broadcasts their plans; if it fails before that, it
   broadcasts the error instead, and every rank raises it.
2. Apply. Every rank applies every plan to its own model (fingerprint
   checked) and the outcomes are all-gathered. A plan that raised on any rank
   is FAIL on every rank (the reason names the rank and the exception); the
   round goes on without it (without the baseline there is no round).
3. Measure. Every rank warms each plan up, measuring its peak memory on
   the way (``runtime.recording.peak_memory.warm_up_measuring_peaks``; per plan the
   median over steps of the max across ranks). Rank 0 records FAIL the
   candidates whose measured peak exceeds the memory budget
   (``FailKind.ERROR``), and every rank leaves them out. Then it runs blocks of rounds:
   rank 0's schedule (the race, then the confirmation: ``planner.statistics.schedule``)
   hands out each block, every rank runs it (``runtime.measuring.measure.run_schedule``)
   and catches its own exception, and the outcomes (times, or the failing
   plan and exception) are all-gathered after each block.
   - Every rank succeeded: rank 0 feeds the per-step max across ranks to the
     schedule, which drops candidates or decides the next block; when it is
     done, rank 0 tells each trial its figures and stores every rank's own
     times.
   - A rank raised inside a step: its peers wait in one of that step's
     collectives until the process group's timeout (``[launch] timeout_s``),
     then raise too. Rank 0 records the trial that raised as FAIL with the
     rank and the exception (``FailKind.ERROR``: not tried again) and
     the rest of the round as FAIL ``FailKind.INTERRUPTED`` (measured by the next
     job). The ranks have issued different collectives by then, so the
     training process group cannot be trusted: every rank raises
     :class:`planner.TrialFailedError` and the job stops (exit 3). Running
     ``prefetch-planner tune`` again, or torchrun's ``--max-restarts``,
     resumes the study.

Every collective of the protocol runs on a separate gloo group (the control
group, ``runtime.ranks.collectives.control_group``) whose timeout is
``2 * timeout_s + 60`` s: long enough for a rank that failed early to wait
while its peers time out in a training collective, short enough that no rank
waits for ever. If a rank died (no report at all),
the gather fails on the others. On that, on Ctrl-C, SIGTERM or a storage
error, the job (``jobs.tune.TuneJob``) records every trial its session
still holds FAIL ``FailKind.INTERRUPTED`` with the reason
(``TuningSession.fail_held``: trials created before the round was handed out
too; ``runtime.ranks.interrupts`` holds a signal back while rank 0 writes the
study). SIGKILL leaves them RUNNING until their heartbeat goes stale and the
next job re-queues them (``MeasuredStage.claim_retries``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch.distributed as dist

from planner.artifacts.plan import Plan
from planner.errors import FailKind, PlannerError, TrialFailedError, one_line
from runtime.apply import apply_plan
from runtime.measuring.measure import Scheduler, run_schedule
from runtime.ranks.collectives import broadcast_from_rank0, broadcast_plans, gather_objects
from runtime.ranks.interrupts import interrupts_deferred
from runtime.recording.peak_memory import peak_of_steps, warm_up_measuring_peaks, warm_up_steps
from runtime.timing import StepCounter, StepFailed
from runtime.workload import Workload


class RoundTrial(Protocol):
    """A trial of the round as rank 0 holds it (``planner.study.MeasuredTrial``)."""

    @property
    def number(self) -> int:
        """The Optuna trial number."""

    @property
    def plan(self) -> Plan:
        """The plan every rank measures."""


TrialT = TypeVar("TrialT", bound=RoundTrial)


class RoundStage(Protocol[TrialT]):
    """What rank 0 asks and tells the study in a round (``planner.study.session.TuningSession``)."""

    def prepare(self) -> list[TrialT]:
        """The round's RUNNING trials, the baseline first (step 1)."""

    def over_budget(self, kept: list[TrialT], peak_bytes: list[int]) -> dict[int, str]:
        """Position in ``kept`` -> why, for the trials whose measured peak exceeds the memory budget, recorded FAIL
        (never the baseline)."""

    def start(self, kept: list[TrialT], peak_bytes: list[int]) -> Scheduler:
        """The schedule of the trials that applied on every rank and fit (the baseline first), with their peaks."""

    def tell(self, asked: list[TrialT], step_ms: list[list[float]], per_rank: list[list[list[float]]]) -> list[Plan]:
        """Record the measured trials: per trial, every step's max across ranks and every rank's own times, ms."""

    def fail(self, asked: list[TrialT], reason: str, kind: FailKind) -> None:
        """Record the trials FAIL with a one-line ``reason``."""


def _is_victim(error: BaseException) -> bool:
    """Whether ``error`` is a collective failing because of another rank (a timeout, a closed peer)."""
    return isinstance(error, getattr(dist, "DistError", ())) or "Timed out" in str(error) or "Connection" in str(error)


@dataclass(frozen=True)
class RoundResult:
    """What a measured round left: measured plans (rank 0 only) and failed trial numbers."""

    plans_measured: list[Plan]
    failed: dict[int, str]


class _Refused:
    """A schedule that could not start: its first block is the reason, which every rank then raises."""

    def __init__(self, reason: str):
        self.reason = reason

    def next_block(self) -> list[list[int]] | None:
        raise PlannerError(self.reason)

    def record(self, block: list[dict[int, float]]) -> None:
        raise AssertionError("a refused schedule runs no block")


def measured_round(
    workload: Workload,
    stage: RoundStage[TrialT] | None,
    warmup_steps: int,
    group: dist.ProcessGroup,
    on_step: Callable[[], None] | None = None,
    on_warm_up: Callable[[int], None] | None = None,
) -> RoundResult:
    """One measured round on every rank (see the Note above).

    Args:
        workload: this rank's workload.
        stage: rank 0: the study's side of the round (its :meth:`RoundStage.prepare` is step 1);
            ``None`` on other ranks.
        warmup_steps: untimed steps per plan before the first block.
        group: the control group (``runtime.ranks.collectives.control_group``).
        on_step: progress callback per step.
        on_warm_up: progress callback, called once before the warm-up with its steps (every plan that applied
            everywhere, ``runtime.recording.peak_memory.warm_up_steps(warmup_steps)`` steps each).

    Returns:
        :class:`RoundResult` (``plans_measured`` empty on ranks other than 0).

    Raises:
        PlannerError: rank 0 could not ask the study (bad storage, ...) or
            could not go on with the schedule.
        TrialFailedError: a rank raised inside a step (the round's trials
            are recorded FAIL first), or a rank did not report (the caller
            fails them: ``TuningSession.fail_held``).
    """
    rank0 = dist.get_rank() == 0
    asked: list[TrialT] = []
    payload: Any = None
    if rank0:
        try:
            asked = stage.prepare()
            payload = [a.plan for a in asked]
        except PlannerError as e:
            payload = e
    plans = broadcast_plans(payload, group)
    round_ = _Round(workload, stage, asked, plans, group)
    keep, failed = round_.apply_everywhere()
    if 0 not in keep:  # the baseline (FSDP2's default, or the plan the model arrived with): nothing to compare with
        if rank0 and stage is not None:
            stage.fail(asked, "not measured: the baseline plan failed to apply, so there is nothing to compare with",
                       FailKind.INTERRUPTED)
        return RoundResult([], {asked[i].number: r for i, r in failed.items()} if rank0 else {})
    return round_.measure(keep, failed, warmup_steps, on_step, on_warm_up)


class _Round:
    """Steps 2 and 3 of the Note on every rank; ``stage`` and ``asked`` on rank 0 only."""

    def __init__(self, workload: Workload, stage: RoundStage | None, asked: list, plans: list[Plan],
                 group: dist.ProcessGroup):
        self.workload, self.stage, self.asked, self.plans, self.group = workload, stage, asked, plans, group
        self.rank0 = dist.get_rank() == 0

    def apply_everywhere(self) -> tuple[list[int], dict[int, str]]:
        """Apply every plan on every rank (fingerprint checked); the plans that failed anywhere are FAIL."""
        local_errors = []
        for plan in self.plans:
            try:
                apply_plan(self.workload.model, plan, check=True)
                local_errors.append(None)
            except Exception as e:  # noqa: BLE001 - any exception fails this plan, not the round
                local_errors.append(one_line(e))
        outcomes = gather_objects(local_errors, self.group)
        keep, failed = [], {}
        for i in range(len(self.plans)):
            reasons = [f"rank {r}: {errs[i]}" for r, errs in enumerate(outcomes) if errs[i] is not None]
            if reasons:
                failed[i] = "applying the plan failed on " + "; ".join(reasons)
            else:
                keep.append(i)
        if self.rank0:
            for i, reason in failed.items():
                self.stage.fail([self.asked[i]], reason, FailKind.ERROR)
        return keep, failed

    def measure(self, keep: list[int], failed: dict[int, str], warmup_steps: int,
                on_step: Callable[[], None] | None, on_warm_up: Callable[[int], None] | None) -> RoundResult:
        """Warm up, then run the schedule's blocks until rank 0's schedule is done; rank 0 tells the study."""
        plans = [self.plans[i] for i in keep]
        if on_warm_up is not None:
            on_warm_up(len(plans) * warm_up_steps(warmup_steps))
        steps = StepCounter()
        local_peaks = self._everywhere(
            keep, lambda: warm_up_measuring_peaks(self.workload, plans, warmup_steps, steps, on_step))
        over: Any = None
        if self.rank0:
            peaks = [peak_of_steps([rank[j] for rank in local_peaks]) for j in range(len(keep))]
            over = self.stage.over_budget([self.asked[i] for i in keep], peaks)
            failed = {**failed, **{keep[j]: reason for j, reason in over.items()}}
        over = set(broadcast_from_rank0(sorted(over) if self.rank0 else None, self.group))
        keep = [i for j, i in enumerate(keep) if j not in over]
        plans = [p for j, p in enumerate(plans) if j not in over]
        schedule: Scheduler | None = None
        if self.rank0:
            try:
                schedule = self.stage.start([self.asked[i] for i in keep],
                                            [p for j, p in enumerate(peaks) if j not in over])
            except PlannerError as e:  # every rank must hear it: the first block is the refusal
                schedule = _Refused(str(e))
        step_ms, per_rank = run_schedule(self.workload, plans, schedule, steps, self.group, on_step,
                                         report=lambda run: self._everywhere(keep, run))
        if not self.rank0:
            return RoundResult([], {})
        with interrupts_deferred():  # a Ctrl-C during the writes waits until every trial is plans_measured
            plans_measured = self.stage.tell([self.asked[i] for i in keep], step_ms, per_rank)
        return RoundResult(plans_measured, {self.asked[i].number: r for i, r in failed.items()})

    def _everywhere(self, keep: list[int], run: Callable[[], Any]) -> list[Any]:
        """``run()`` on every rank, then every rank's result; a step that raised anywhere fails the round."""
        try:
            report: dict[str, Any] = {"result": run()}
        except StepFailed as e:
            report = {"index": keep[e.index], "error": one_line(e.error), "victim": _is_victim(e.error)}
        reports = gather_objects(report, self.group)
        errors = [(r, rep) for r, rep in enumerate(reports) if "error" in rep]
        if not errors:
            return [rep["result"] for rep in reports]
        causes = [(r, rep) for r, rep in errors if not rep["victim"]] or errors
        index = min(rep["index"] for _, rep in causes)
        reason = "; ".join(f"rank {r}: {rep['error']}" for r, rep in causes)
        trial = "a trial"
        if self.rank0:
            trial = f"trial {self.asked[index].number}"
            self.stage.fail([self.asked[index]], reason, FailKind.ERROR)
            self.stage.fail([a for i, a in enumerate(self.asked) if i != index],
                            f"not measured: {trial} failed in the same round ({reason})", FailKind.INTERRUPTED)
        raise TrialFailedError(
            f"{trial} failed on {reason}; it is recorded as FAIL and this job stops (its ranks' process group "
            "is out of step after a failure inside a training step): run `prefetch-planner tune` again to go on"
        )
