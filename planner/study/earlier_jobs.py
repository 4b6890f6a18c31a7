"""What the earlier jobs of a measured study left for this one: the plans of dead jobs' stale trials re-queued, the
plans a stopped job left unmeasured, the plans settled already, and the study's recommendation to race again.

Several jobs share one study (one SQLite file or a PostgreSQL server). A job
that dies leaves stale trials that the next job fails and re-queues
(:meth:`EarlierJobs.claim_retries`); a job that stops leaves interrupted
trials whose plans the next job races first (:meth:`EarlierJobs.interrupted`);
a plan measured, being measured, or failed on a rank is not measured again
(:meth:`EarlierJobs.settled_keys`). The trials a job claims are held by its
:class:`~planner.study.measured.MeasuredStage`.
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import TYPE_CHECKING

import optuna

from planner.errors import FailKind, SpaceParamsError
from planner.storages.bulk import running_without_heartbeat
from planner.study.candidates import Candidate, plan_key, trial_candidate
from planner.study.measured import MeasuredStage, MeasuredTrial
from planner.study.records import Failure, MeasuredTrialRecord

if TYPE_CHECKING:
    from planner.artifacts.memory_budget import PeakBudget
    from planner.study.queries import BestPlan

logger = logging.getLogger(__name__)


class EarlierJobs:
    """What the study's earlier jobs left, read and claimed for this job's round (module docstring).

    Args:
        stage: this job's measured stage: the study, its storage, the profile, the space and the simulator a plan
            is rebuilt and predicted with; it holds the trials :meth:`claim_retries` claims.

    Raises (every method):
        StorageError: the database cannot be read or written.
    """

    def __init__(self, stage: MeasuredStage):
        self.stage = stage

    def claim_retries(self) -> list[MeasuredTrial]:
        """Fail stale trials, then take over the WAITING trials that re-queue their plans.

        Stale = RUNNING with no heartbeat for ``grace_period_s`` (its job
        died). Optuna's ``fail_stale_trials`` marks them FAIL and its retry
        callback enqueues each plan again as a WAITING trial (at most
        ``max_retry`` times); a WAITING trial is claimed atomically
        (``set_trial_state_values`` to RUNNING), so one job measures it.
        """
        out = []
        with self.stage.storage_errors(), warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(self.stage.study)
            self._fail_never_beat()
            for t in self.stage.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)):
                trial_id = self.stage.storage.get_trial_id_from_study_id_trial_number(self.stage.study_id, t.number)
                try:
                    if not self.stage.storage.set_trial_state_values(trial_id, optuna.trial.TrialState.RUNNING):
                        continue  # another job claimed it first
                except optuna.exceptions.UpdateFinishedTrialError:
                    continue
                self.stage.heartbeat.add(trial_id)
                self.stage.record(trial_id, MeasuredTrialRecord(job=self.stage.job))
                if MeasuredTrialRecord.from_trial(t).user_plan:  # each job races the plan its own model arrived with
                    self.stage.fail_one(t.number, trial_id, Failure("the plan a model arrived with is raced by the job "
                                                               "that has that model", FailKind.INTERRUPTED))
                    continue
                try:
                    c = trial_candidate(t, self.stage.profile, self.stage.space, self.stage.simulator)
                except SpaceParamsError as e:
                    self.stage.fail_one(t.number, trial_id, Failure(f"cannot rebuild the plan: {e}", FailKind.ERROR))
                    continue
                # The prediction it is raced on, on this job's profile (the attributes Optuna copied are the first
                # trial's).
                self.stage.record(trial_id, MeasuredTrialRecord(predicted_ms=c.predicted_ms,
                                                                predicted_peak_bytes=c.predicted_peak_bytes))
                out.append(MeasuredTrial(t.number, trial_id, c, MeasuredTrialRecord.from_trial(t).retry_of))
        if out:
            logger.info(f"      resuming: {len(out)} plan(s) of stale trials re-queued "
                        f"(trials {', '.join(str(r.retry_of) for r in out)})")
        return out

    def _fail_never_beat(self) -> None:
        """Fail, as Optuna's ``fail_stale_trials`` does, the RUNNING trials that never recorded a heartbeat and
        started more than ``grace_period_s`` ago, and re-queue their plans through the storage's stale-trial
        callback.

        A job creates a trial RUNNING, then records its first heartbeat (:meth:`Heartbeat.add`): two transactions.
        Killed between them (a node lost), it leaves a trial that Optuna's check skips, as it looks only at trials
        with a heartbeat; it stayed RUNNING for good, and its plan counted as measured elsewhere.
        """
        grace = self.stage.config.study.grace_period_s
        callback = self.stage.storage.get_heartbeat_stale_trial_callback()
        for trial_id in running_without_heartbeat(self.stage.storage, self.stage.config.name, grace):
            try:
                if not self.stage.storage.set_trial_state_values(trial_id, optuna.trial.TrialState.FAIL):
                    continue
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # another job failed or finished it first
            if callback is not None:
                callback(self.stage.study, copy.deepcopy(self.stage.storage.get_trial(trial_id)))

    def settled_keys(self) -> set[str]:
        """:func:`~planner.study.candidates.plan_key` of plans not to measure again in this study.

        Measured (COMPLETE), being measured by another job (RUNNING), or
        failed on a rank (FAIL with :attr:`FailKind.ERROR`). Plans whose
        trial was interrupted or went stale are measured again.
        """
        with self.stage.storage_errors():
            trials = self.stage.study.get_trials(deepcopy=False)
        keys = set()
        for t in trials:
            r = MeasuredTrialRecord.from_trial(t)
            settled = r.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING) or (
                r.state == optuna.trial.TrialState.FAIL and r.failure is not None and r.failure.kind == FailKind.ERROR)
            if r.plan_key and settled:
                keys.add(r.plan_key)
        return keys

    def interrupted(self, exclude: set[str], budget: PeakBudget | None = None) -> list[Candidate]:
        """The plans of trials a stopping job failed as interrupted, to measure again, best predicted first.

        A job that stops for any reason but SIGKILL records the trials it held
        FAIL :attr:`FailKind.INTERRUPTED` (:meth:`fail_held`, the rank
        protocol's failed round); unlike a stale trial, Optuna does not re-queue
        them. A plan comes back while no trial settled it since (its
        :func:`~planner.study.candidates.plan_key` not in ``exclude``: see
        :meth:`settled_keys`) and it was interrupted at most ``[study]
        max_retry + 1`` times, the bound Optuna's retry callback puts on a stale
        plan. FSDP2's default never comes back this way: every round measures
        it. A trial whose parameters no longer build a plan for this profile, or
        whose plan ``budget`` does not admit (``candidates.candidate``), is left out.
        """
        with self.stage.storage_errors():
            trials = self.stage.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,))
        times: dict[str, int] = {}
        first: dict[str, optuna.trial.FrozenTrial] = {}
        for t in trials:
            r = MeasuredTrialRecord.from_trial(t)
            if (r.plan_key and r.failure is not None and r.failure.kind == FailKind.INTERRUPTED and not r.is_baseline
                    and not r.user_plan):
                times[r.plan_key] = times.get(r.plan_key, 0) + 1
                first.setdefault(r.plan_key, t)
        out = []
        for key, t in first.items():
            if key in exclude or times[key] > self.stage.config.study.max_retry + 1:
                continue
            try:
                c = trial_candidate(t, self.stage.profile, self.stage.space, self.stage.simulator, budget=budget)
            except SpaceParamsError:
                continue
            if c is not None and plan_key(c.plan) == key and not c.plan.is_default_for(self.stage.profile):
                out.append(c)  # not when the parameters build another plan for this profile than the one interrupted
        return sorted(out, key=lambda c: c.predicted_ms)

    def recommendation(self) -> BestPlan:
        """The study's recommendation for this profile's model and world size, read on the storage this stage holds.

        Raises:
            StudyNotFoundError: no job of the study has concluded for this model and world size.
            StorageError: the storage cannot be read.
        """
        from planner.errors import StudyNotFoundError
        from planner.study.queries import best_in

        with self.stage.storage_errors():
            best = best_in(self.stage.storage, self.stage.study, self.stage.config.name, self.stage.profile.fingerprint)
        if best is None:
            raise StudyNotFoundError(f"study {self.stage.config.name!r} has no concluded tuning job for this model yet")
        return best

    def recommended(self, budget: PeakBudget | None = None) -> Candidate | None:
        """The study's recommendation for this profile's model and world size, or its pending plan, as a candidate
        to race again ([Note: One recommendation, re-confirmed by every job]); ``None`` when it is FSDP2's default
        with nothing pending, there is none yet, its plan no longer builds for this profile, or ``budget`` does not
        admit it."""
        from planner.study.queries import best_in

        with self.stage.storage_errors():
            best = best_in(self.stage.storage, self.stage.study, self.stage.config.name, self.stage.profile.fingerprint)
            if best is None:
                return None
            held = best.recommendation.pending if best.keeps_baseline else best.recommendation.trial
            if held is None:
                return None
            trial = self.stage.study.trials[held.number]
        try:
            return trial_candidate(trial, self.stage.profile, self.stage.space, self.stage.simulator, budget=budget,
                                   reconfirms=trial.number)
        except SpaceParamsError:
            return None
