"""The study's recommendation: the one plan ``tune``'s last line, ``studies best`` and ``load_best_plan`` hand back.

[Note: One recommendation, re-confirmed by every job]
Picking the lowest ratio among every job's "faster" confirmations is the
winner's curse again, across jobs: each confirmation errs with chance 2.5%,
so over k jobs some false "faster" stands with chance 1 - 0.975^k, and the
lowest of several noisy ratios is biased low. So:
- a job's verdict is about its own race's survivor against the default of
  the same job (their rounds are paired);
- a later job races the current recommendation again among its candidates
  (a fresh trial of the same plan, ``reconfirms`` = the trial that
  recommended it), so it has to win a fresh race and a fresh confirmation;
- the study recommends what its latest decided job concluded: the plan that
  job confirmed faster in total time across processes, else FSDP2's
  default. A plan found faster only in its launches (``PROVISIONAL``), or
  confirmed faster before the total-time estimand (a median-based verdict
  from one process), is the job's *pending* plan: not applied, raced again
  by the in-loop tuner's next start and by later jobs, each adding a fresh
  launch ([Note: Provisional verdicts] in ``planner.statistics.verdict``).
  A job is decided once its survivor is confirmed, or when its race dropped
  every candidate; a job whose confirmation never ran (its launches died)
  leaves the recommendation as it was.
The plan applied is then false at most 2.5% of the time over every look its
chain had ([Note: Looks spent over the restart chain] in
``planner.statistics.looks``), however many jobs ran, and the ratio it shows
is the one measured on fresh launches by the job that recommends it. Every
confirmation stays in the study (``studies show`` lists them per plan).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import optuna

from planner.statistics.verdict import Confirmation, Verdict
from planner.study.records import MeasuredTrialRecord


@dataclass(frozen=True)
class JobVerdict:
    """What one tuning job of a study concluded.

    Attributes:
        job: the job's name (trial attribute ``job``).
        default: its trial of FSDP2's default (COMPLETE).
        survivor: its race's survivor; ``None`` when the race dropped every candidate (or had none).
        last_trial: its last trial's number (orders jobs).
    """

    job: str | None
    default: MeasuredTrialRecord
    survivor: MeasuredTrialRecord | None
    last_trial: int

    @property
    def decided(self) -> bool:
        """Whether the job concluded: its survivor is confirmed, or there is none."""
        return self.survivor is None or self.survivor.confirmation is not None

    @property
    def faster(self) -> MeasuredTrialRecord | None:
        """The survivor when it is confirmed faster than the job's default, else ``None``."""
        s = self.survivor
        return s if s is not None and s.verdict == Verdict.FASTER else None

    @property
    def recommended(self) -> MeasuredTrialRecord | None:
        """The survivor when it is confirmed faster in total time across processes (applied), else ``None``."""
        s = self.survivor
        if s is None or s.confirmation is None or not s.confirmation.total_time:
            return None
        return s if s.verdict == Verdict.FASTER else None

    @property
    def pending(self) -> MeasuredTrialRecord | None:
        """The survivor when it waits on more launches, not applied: provisional, or confirmed faster before the
        total-time estimand (a median-based verdict from one process); else ``None``."""
        s = self.survivor
        if s is None or s.confirmation is None:
            return None
        c = s.confirmation
        return s if c.verdict == Verdict.PROVISIONAL or (c.verdict == Verdict.FASTER and not c.total_time) else None


@dataclass(frozen=True)
class Recommendation:
    """The plan a study recommends ([Note: One recommendation, re-confirmed by every job]).

    Attributes:
        trial: the recommended plan's trial: the job's survivor confirmed faster across processes, else the job's
            FSDP2 default.
        job: the job that decided it.
    """

    trial: MeasuredTrialRecord
    job: JobVerdict

    @property
    def is_default(self) -> bool:
        """Whether it is FSDP2's default (nothing confirmed faster across processes by the deciding job)."""
        return self.job.recommended is None

    @property
    def pending(self) -> MeasuredTrialRecord | None:
        """The deciding job's survivor that waits on more launches (:attr:`JobVerdict.pending`): not applied, raced
        again at the in-loop tuner's next start and by later jobs."""
        return self.job.pending

    @property
    def confirmation(self) -> Confirmation | None:
        """The deciding job's confirmation of its survivor (faster or not); ``None`` if its race dropped all."""
        return self.job.survivor.confirmation if self.job.survivor is not None else None

    @property
    def default_ms(self) -> float | None:
        """FSDP2's default's median step in the deciding job's race, ms."""
        return self.job.default.measured_ms


def _is_survivor(r: MeasuredTrialRecord) -> bool:
    return (r.race is not None and r.race.survivor) or r.confirmation is not None  # older studies: the confirmed one


def job_verdicts(records: Iterable[MeasuredTrialRecord]) -> list[JobVerdict]:
    """Every job that measured FSDP2's default to completion, oldest first (by its last trial number)."""
    jobs: dict[str | None, list[MeasuredTrialRecord]] = {}
    for r in records:
        if r.state == optuna.trial.TrialState.COMPLETE:
            jobs.setdefault(r.job, []).append(r)
    out = []
    for job, trials in jobs.items():
        defaults = [r for r in trials if r.is_default]
        if not defaults:
            continue
        survivors = [r for r in trials if not r.is_default and _is_survivor(r)]
        out.append(JobVerdict(job, defaults[-1], survivors[-1] if survivors else None,
                              max(r.number for r in trials)))
    return sorted(out, key=lambda v: v.last_trial)


def recommend(records: Iterable[MeasuredTrialRecord],
              matches: Callable[[JobVerdict], bool] = lambda v: True) -> Recommendation | None:
    """The study's recommendation: what its latest decided job (among those ``matches`` accepts, e.g. made for one
    model and world size) concluded; ``None`` when no job is decided."""
    for verdict in reversed(job_verdicts(records)):
        if verdict.decided and matches(verdict):
            return Recommendation(verdict.recommended or verdict.default, verdict)
    return None


def confirmation_history(records: Iterable[MeasuredTrialRecord]) -> dict[str, list[MeasuredTrialRecord]]:
    """Per plan (``plan_key``), every trial that confirmed it, oldest first: the plan's history across jobs."""
    out: dict[str, list[MeasuredTrialRecord]] = {}
    for r in sorted(records, key=lambda r: r.number):
        if r.confirmation is not None and r.plan_key:
            out.setdefault(r.plan_key, []).append(r)
    return out
