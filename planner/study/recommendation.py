"""The study's recommendation: the one plan ``tune``'s last line, ``studies best`` and ``load_best_plan`` hand back.

[Note: One recommendation, re-confirmed by every job]
Picking the lowest ratio among every job's "faster" confirmations is the
winner's curse again, across jobs: each confirmation errs with chance 2.5%,
so over k jobs some false "faster" stands with chance 1 - 0.975^k, and the
lowest of several noisy ratios is biased low. So:
- a job's verdict is about its own race's survivor against the baseline of
  the same job (their rounds are paired): FSDP2's default, or the plan the
  model arrived with, which every verdict of that job compares against;
- a later job races the current recommendation again among its candidates
  (a fresh trial of the same plan, ``reconfirms`` = the trial that
  recommended it), so it has to win a fresh race and a fresh confirmation;
- the study recommends what its latest decided job concluded: the plan that
  job confirmed faster in total time across processes, else its baseline
  (FSDP2's default, or the plan the model arrived with, applied again as it
  was). A plan found faster only in its launches (``PROVISIONAL``), or
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
        baseline: its trial of the baseline (COMPLETE): FSDP2's default, or the plan the model arrived with.
        survivor: its race's survivor; ``None`` when the race dropped every candidate (or had none).
        last_trial: its last trial's number (orders jobs).
    """

    job: str | None
    baseline: MeasuredTrialRecord
    survivor: MeasuredTrialRecord | None
    last_trial: int

    @property
    def decided(self) -> bool:
        """Whether the job concluded: its survivor is confirmed, or there is none."""
        return self.survivor is None or self.survivor.confirmation is not None

    @property
    def faster(self) -> MeasuredTrialRecord | None:
        """The survivor when it is confirmed faster than the job's baseline, else ``None``."""
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
            baseline.
        job: the job that decided it.
    """

    trial: MeasuredTrialRecord
    job: JobVerdict

    @property
    def keeps_baseline(self) -> bool:
        """Whether it is the deciding job's baseline (nothing confirmed faster than it across processes)."""
        return self.job.recommended is None

    @property
    def baseline_is_users(self) -> bool:
        """Whether the deciding job's baseline is the plan the model arrived with, not FSDP2's default."""
        return bool(self.job.baseline.user_plan)

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
    def baseline_ms(self) -> float | None:
        """The baseline's median step in the deciding job's race, ms."""
        return self.job.baseline.measured_ms


def _is_survivor(r: MeasuredTrialRecord) -> bool:
    return (r.race is not None and r.race.survivor) or r.confirmation is not None  # older studies: the confirmed one


def job_verdicts(records: Iterable[MeasuredTrialRecord]) -> list[JobVerdict]:
    """Every job that measured its baseline to completion, oldest first (by its last trial number)."""
    jobs: dict[str | None, list[MeasuredTrialRecord]] = {}
    for r in records:
        if r.state == optuna.trial.TrialState.COMPLETE:
            jobs.setdefault(r.job, []).append(r)
    out = []
    for job, trials in jobs.items():
        baselines = [r for r in trials if r.is_baseline]
        if not baselines:
            continue
        survivors = [r for r in trials if not r.is_baseline and _is_survivor(r)]
        out.append(JobVerdict(job, baselines[-1], survivors[-1] if survivors else None,
                              max(r.number for r in trials)))
    return sorted(out, key=lambda v: v.last_trial)


def recommend(records: Iterable[MeasuredTrialRecord],
              matches: Callable[[JobVerdict], bool] = lambda v: True) -> Recommendation | None:
    """The study's recommendation: what its latest decided job (among those ``matches`` accepts, e.g. made for one
    model and world size) concluded; ``None`` when no job is decided."""
    for verdict in reversed(job_verdicts(records)):
        if verdict.decided and matches(verdict):
            return Recommendation(verdict.recommended or verdict.baseline, verdict)
    return None


def confirmation_history(records: Iterable[MeasuredTrialRecord]) -> dict[str, list[MeasuredTrialRecord]]:
    """Per plan (``plan_key``), every trial that confirmed it, oldest first: the plan's history across jobs."""
    out: dict[str, list[MeasuredTrialRecord]] = {}
    for r in sorted(records, key=lambda r: r.number):
        if r.confirmation is not None and r.plan_key:
            out.setdefault(r.plan_key, []).append(r)
    return out
