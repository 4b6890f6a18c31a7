"""The rank protocol of a measured round: who talks to the study, who waits for whom, for how long.

[Note: Rank protocol of a measured round]
Every rank runs :func:`measured_round` with the same arguments; rank 0 alone
holds the study (a :class:`RoundStage`: ``planner.study.MeasuredStage``).

1. Plans. Rank 0 asks the study for the round's trials (FSDP2's default
   first, then re-queued plans of dead jobs, then the best simulated plans
   not yet measured) and broadcasts their plans; if it fails before that, it
   broadcasts the error instead, and every rank raises it.
2. Apply. Every rank applies every plan to its own model (fingerprint
   checked) and the outcomes are all-gathered. A plan that raised on any rank
   is FAIL on every rank (the reason names the rank and the exception); the
   round goes on without it (without FSDP2's default there is no round).
3. Measure. Every rank warms each plan up, measuring its peak memory on
   the way (``runtime.peak_memory.warm_up_measuring_peaks``; per plan the
   median over steps of the max across ranks). Rank 0 records FAIL the
   candidates whose measured peak exceeds the memory budget
   (``FailKind.ERROR``), and every rank leaves them out. Then it runs blocks of rounds:
   rank 0's schedule (the race, then the confirmation: ``planner.statistics.schedule``)
   hands out each block, every rank runs it (``runtime.measure.run_block``)
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
group) whose timeout is ``2 * timeout_s + 60`` s: long enough for a rank that
failed early to wait while its peers time out in a training collective,
short enough that no rank waits for ever. If a rank died (no report at all),
the gather fails on the others. On that, on Ctrl-C, SIGTERM or a storage
error, the job (``jobs.tune.TuneJob``) records every trial its stage
still holds FAIL ``FailKind.INTERRUPTED`` with the reason
(``MeasuredStage.fail_held``: trials created before the round was handed out
too; ``runtime.interrupts`` holds a signal back while rank 0 writes the
study). SIGKILL leaves them RUNNING until their heartbeat goes stale and the
next job re-queues them (``MeasuredStage.claim_retries``).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Callable, Protocol, TypeVar

import torch.distributed as dist

from planner.errors import FailKind, PlannerError, TrialFailedError
from planner.artifacts.plan import Plan
from runtime.apply import apply_plan
from runtime.interrupts import interrupts_deferred
from runtime.measure import StepCounter, StepFailed, run_block
from runtime.peak_memory import peak_of_steps, warm_up_measuring_peaks
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


class Scheduler(Protocol):
    """Rank 0's schedule of the round's steps (``planner.statistics.schedule.Schedule``)."""

    def next_block(self) -> list[list[int]] | None:
        """The next rounds (plan indices in running order), ``None`` when done."""

    def record(self, block: list[dict[int, float]]) -> None:
        """The block's step times: per round, plan index -> ms (max across ranks)."""


class RoundStage(Protocol[TrialT]):
    """What rank 0 asks and tells the study in a round (``planner.study.MeasuredStage`` over its ``MeasuredTrial``)."""

    def over_budget(self, kept: list[TrialT], peak_bytes: list[int]) -> dict[int, str]:
        """Position in ``kept`` -> why, for the trials whose measured peak exceeds the memory budget, recorded FAIL
        (never FSDP2's default, the baseline)."""

    def start(self, kept: list[TrialT], peak_bytes: list[int]) -> Scheduler:
        """The schedule of the trials that applied on every rank and fit (FSDP2's default first), with their peaks."""

    def tell(self, asked: list[TrialT], step_ms: list[list[float]], per_rank: list[list[list[float]]]) -> list[Plan]:
        """Record the measured trials: per trial, every step's max across ranks and every rank's own times, ms."""

    def fail(self, asked: list[TrialT], reason: str, kind: FailKind) -> None:
        """Record the trials FAIL with a one-line ``reason``."""


Prepare = Callable[[], tuple[RoundStage[TrialT], list[TrialT]]]


def control_timeout_s(timeout_s: float) -> float:
    """The control group's timeout for a process-group timeout of ``timeout_s``, in s."""
    return 2 * timeout_s + 60


def control_group(timeout_s: float) -> dist.ProcessGroup:
    """A gloo group over every rank for the protocol's collectives (all ranks call this)."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=control_timeout_s(timeout_s)))


def broadcast_from_rank0(payload: Any, group: dist.ProcessGroup) -> Any:
    """Rank 0's ``payload`` on every rank; ``{"error": msg}`` raises :class:`PlannerError` everywhere."""
    box = [payload]
    dist.broadcast_object_list(box, src=0, group=group)
    if isinstance(box[0], dict) and "error" in box[0]:
        raise PlannerError(box[0]["error"])
    return box[0]


def gather(local: Any, group: dist.ProcessGroup) -> list[Any]:
    """``all_gather_object`` on the control group.

    Raises:
        TrialFailedError: a rank did not report (it died, or it is stuck past
            the control group's timeout).
    """
    out: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(out, local, group=group)
    except Exception as e:  # noqa: BLE001 - gloo reports a dead peer in several ways
        raise TrialFailedError(f"a rank did not report to rank {dist.get_rank()}: {one_line(e)}", local=True) from None
    return out


def one_line(e: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line, at most ``limit`` characters (for FAIL reasons and errors)."""
    text = f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_victim(error: BaseException) -> bool:
    """Whether ``error`` is a collective failing because of another rank (a timeout, a closed peer)."""
    return isinstance(error, getattr(dist, "DistError", ())) or "Timed out" in str(error) or "Connection" in str(error)


@dataclass(frozen=True)
class RoundResult:
    """What a measured round left: measured plans (rank 0 only) and failed trial numbers."""

    told: list[Plan]
    failed: dict[int, str]


def measured_round(
    workload: Workload,
    prepare: Prepare[TrialT] | None,
    warmup_steps: int,
    group: dist.ProcessGroup,
    on_step: Callable[[], None] | None = None,
) -> RoundResult:
    """One measured round on every rank (see the Note above).

    Args:
        workload: this rank's workload.
        prepare: rank 0: returns the stage and the round's RUNNING trials
            (step 1), FSDP2's default first; ``None`` on other ranks.
        warmup_steps: untimed steps per plan before the first block.
        group: the control group (:func:`control_group`).
        on_step: progress callback per step.

    Returns:
        :class:`RoundResult` (``told`` empty on ranks other than 0).

    Raises:
        PlannerError: rank 0 could not ask the study (bad storage, ...) or
            could not go on with the schedule.
        TrialFailedError: a rank raised inside a step (the round's trials
            are recorded FAIL first), or a rank did not report (the caller
            fails them: ``MeasuredStage.fail_held``).
    """
    rank = dist.get_rank()
    stage: RoundStage[TrialT] | None = None
    asked: list[TrialT] = []
    payload: Any = None
    if rank == 0:
        try:
            stage, asked = prepare()
            payload = [a.plan.to_dict() for a in asked]
        except PlannerError as e:
            payload = {"error": str(e)}
    plans = [Plan.from_dict(d) for d in broadcast_from_rank0(payload, group)]
    round_ = _Round(workload, stage, asked, plans, group)
    keep, failed = round_.apply_everywhere()
    if 0 not in keep:  # FSDP2's default is the baseline: without it nothing can be compared
        if rank == 0 and stage is not None:
            stage.fail(asked, "not measured: FSDP2's default plan failed to apply, so there is nothing to compare "
                              "with", FailKind.INTERRUPTED)
        return RoundResult([], {asked[i].number: r for i, r in failed.items()} if rank == 0 else {})
    return round_.measure(keep, failed, warmup_steps, on_step)


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
        outcomes = gather(local_errors, self.group)
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
                on_step: Callable[[], None] | None) -> RoundResult:
        """Warm up, then run the schedule's blocks until rank 0's schedule is done; rank 0 tells the study."""
        plans = [self.plans[i] for i in keep]
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
        schedule, start_error = None, None
        if self.rank0:
            try:
                schedule = self.stage.start([self.asked[i] for i in keep],
                                            [p for j, p in enumerate(peaks) if j not in over])
            except PlannerError as e:  # every rank must hear it (next broadcast)
                start_error = str(e)
        step_ms: list[list[float]] = [[] for _ in keep]
        per_rank: list[list[list[float]]] = [[[] for _ in range(dist.get_world_size())] for _ in keep]
        while True:
            payload: Any = None
            if self.rank0 and start_error is not None:
                payload = {"error": start_error}
            elif self.rank0:
                try:
                    payload = schedule.next_block()
                except Exception as e:  # noqa: BLE001 - every rank must hear that rank 0 cannot go on
                    payload = {"error": f"the measured round's schedule failed: {one_line(e)}"}
            block = broadcast_from_rank0(payload, self.group)
            if block is None:
                break
            reports = self._everywhere(keep, lambda: run_block(self.workload, plans, block, steps, on_step))
            if self.rank0:
                maxed = []
                for k, order in enumerate(block):
                    maxed.append({j: max(rep[k][pos] for rep in reports) for pos, j in enumerate(order)})
                    for pos, j in enumerate(order):
                        step_ms[j].append(maxed[-1][j])
                        for r, rep in enumerate(reports):
                            per_rank[j][r].append(rep[k][pos])
                schedule.record(maxed)
        if not self.rank0:
            return RoundResult([], {})
        with interrupts_deferred():  # a Ctrl-C during the writes waits until every trial is told
            told = self.stage.tell([self.asked[i] for i in keep], step_ms, per_rank)
        return RoundResult(told, {self.asked[i].number: r for i, r in failed.items()})

    def _everywhere(self, keep: list[int], run: Callable[[], Any]) -> list[Any]:
        """``run()`` on every rank, then every rank's result; a step that raised anywhere fails the round."""
        try:
            report: dict[str, Any] = {"result": run()}
        except StepFailed as e:
            report = {"index": keep[e.index], "error": one_line(e.error), "victim": _is_victim(e.error)}
        reports = gather(report, self.group)
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
