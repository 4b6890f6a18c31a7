"""The measured study ``NAME``: the lifecycle of its trials, rank 0's side of a measured round.

Each trial is one plan measured on the real ranks: FSDP2's default and the
candidates, created with the same parameters as their simulated trial;
objective = measured step ms (median over interleaved steps, max across
ranks). What to measure and what the measurements mean is the
:class:`~planner.study.session.TuningSession`'s to decide; this stage creates,
claims, fails and tells the trials.

Several jobs may share one study (one SQLite file or a PostgreSQL server):
each creates its own RUNNING trials, keeps them alive with a
:class:`~planner.study.heartbeat.Heartbeat`, and skips plans other jobs
measured or are measuring; a job that dies leaves stale trials that the next
job fails and re-queues (:meth:`MeasuredStage.claim_retries`), and a job that
stops leaves interrupted trials whose plans the next job races first
(:meth:`MeasuredStage.interrupted`).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import optuna

from planner.artifacts.config import StudyConfig
from planner.artifacts.plan import Plan
from planner.artifacts.profile import Profile
from planner.errors import FailKind, SpaceParamsError
from planner.simulation.simulator import Simulator
from planner.storages import storage_errors
from planner.storages.archive import save_measured_plans, save_profile, update_profile
from planner.storages.bulk import running_without_heartbeat
from planner.study.candidates import Candidate, plan_key
from planner.study.heartbeat import Heartbeat
from planner.study.provenance import OBJECTIVE, MeasuredPlan, with_confirmation
from planner.study.records import Failure, MeasuredTrialRecord, StudyRecord
from planner.study.search_space import SearchSpace
from planner.study.simulated import name_objective

if TYPE_CHECKING:
    from planner.study.queries import BestPlan


def job_name() -> str:
    """A new tuning job's name: host, process id and a random suffix (trial attribute ``job``)."""
    import os
    import socket
    import uuid

    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class MeasuredTrial:
    """A RUNNING trial of the measured study and the plan it measures.

    Attributes:
        number: the Optuna trial number.
        trial_id: the storage's trial id (heartbeats).
        plan: the plan, built from the trial's parameters for this profile.
        predicted_ms: the simulated step time, ms.
        predicted_peak_bytes: the simulated peak memory, bytes.
        retry_of: for a re-queued stale trial, the number of the trial first
            failed (Optuna's ``failed_trial`` system attribute), else ``None``.
        reconfirms: for the study's recommendation raced again, the trial that recommended it.
        user_plan: the plan the model arrived with, the round's baseline (``Candidate.user_plan``).
    """

    number: int
    trial_id: int
    plan: Plan
    predicted_ms: float
    predicted_peak_bytes: int
    retry_of: int | None = None
    reconfirms: int | None = None
    user_plan: bool = False


class MeasuredStage:
    """The trials of study ``NAME`` one job creates, holds and tells.

    One job's round: :meth:`claim_retries` (fail stale trials of dead jobs,
    take over their re-queued plans), :meth:`settled_keys` (plans not to
    measure again), :meth:`interrupted` (plans a stopped job left unmeasured),
    :meth:`ask` (one RUNNING trial per candidate, heartbeat on), then
    :meth:`tell` or :meth:`fail` (:meth:`fail_held` when the job stops
    early), and :meth:`close`. Trials are created RUNNING directly in the
    storage, so concurrent jobs on one study never take each other's trials;
    Optuna numbers them.

    Args:
        config: the study.
        storage: Optuna's RDB storage (``planner.storages.open_storage``).
        simulator: the profile's simulator (a re-queued plan's prediction).
        job: this job's name (trial user attribute ``job``).
        space: the search space (rebuilds a re-queued trial's plan).

    Raises (every method):
        StorageError: the database cannot be written (e.g. locked too long).
    """

    def __init__(self, config: StudyConfig, storage: optuna.storages.RDBStorage, simulator: Simulator, job: str,
                 space: SearchSpace, source: str = "tune"):
        self.config = config
        self.source = source
        self.storage = storage
        self.simulator = simulator
        self.profile = simulator.profile
        self.job = job
        self.space = space
        with self._storage_errors():
            self.study = optuna.create_study(
                study_name=config.name, storage=storage, direction="minimize", load_if_exists=True
            )
            for key, value in StudyRecord(space.name).to_user_attrs().items():
                self.study.set_user_attr(key, value)
            name_objective(self.study, OBJECTIVE)  # optuna-dashboard's label for the trials' value
            self.study_id = storage.get_study_id_from_name(config.name)
            self.profile_id = save_profile(storage.engine, config.name, self.profile)
        self.heartbeat = Heartbeat(storage, config.study.heartbeat_interval_s)

    def _storage_errors(self) -> contextlib.AbstractContextManager[None]:
        return storage_errors(self.config.storage_url)

    def _record(self, trial_id: int, record: MeasuredTrialRecord) -> None:
        for key, value in record.to_user_attrs().items():
            self.storage.set_trial_user_attr(trial_id, key, value)

    def claim_retries(self) -> list[MeasuredTrial]:
        """Fail stale trials, then take over the WAITING trials that re-queue their plans.

        Stale = RUNNING with no heartbeat for ``grace_period_s`` (its job
        died). Optuna's ``fail_stale_trials`` marks them FAIL and its retry
        callback enqueues each plan again as a WAITING trial (at most
        ``max_retry`` times); a WAITING trial is claimed atomically
        (``set_trial_state_values`` to RUNNING), so one job measures it.
        """
        out = []
        with self._storage_errors(), warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(self.study)
            self._fail_never_beat()
            for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)):
                trial_id = self.storage.get_trial_id_from_study_id_trial_number(self.study_id, t.number)
                try:
                    if not self.storage.set_trial_state_values(trial_id, optuna.trial.TrialState.RUNNING):
                        continue  # another job claimed it first
                except optuna.exceptions.UpdateFinishedTrialError:
                    continue
                self.heartbeat.add(trial_id)
                self._record(trial_id, MeasuredTrialRecord(job=self.job))
                if MeasuredTrialRecord.from_trial(t).user_plan:  # each job races the plan its own model arrived with
                    self._fail_one(t.number, trial_id, Failure("the plan a model arrived with is raced by the job "
                                                               "that has that model", FailKind.INTERRUPTED))
                    continue
                try:
                    plan = self.space.build(t.params, self.profile)
                except SpaceParamsError as e:
                    self._fail_one(t.number, trial_id, Failure(f"cannot rebuild the plan: {e}", FailKind.ERROR))
                    continue
                result = self.simulator.run(plan)
                retry_of = MeasuredTrialRecord.from_trial(t).retry_of
                out.append(MeasuredTrial(t.number, trial_id, plan, result.step_ms, result.peak_bytes, retry_of))
        return out

    def _fail_never_beat(self) -> None:
        """Fail, as Optuna's ``fail_stale_trials`` does, the RUNNING trials that never recorded a heartbeat and
        started more than ``grace_period_s`` ago, and re-queue their plans through the storage's stale-trial
        callback.

        A job creates a trial RUNNING, then records its first heartbeat (:meth:`Heartbeat.add`): two transactions.
        Killed between them (a node lost), it leaves a trial that Optuna's check skips, as it looks only at trials
        with a heartbeat; it stayed RUNNING for good, and its plan counted as measured elsewhere.
        """
        grace = self.config.study.grace_period_s
        callback = self.storage.get_heartbeat_stale_trial_callback()
        for trial_id in running_without_heartbeat(self.storage, self.config.name, grace):
            try:
                if not self.storage.set_trial_state_values(trial_id, optuna.trial.TrialState.FAIL):
                    continue
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # another job failed or finished it first
            if callback is not None:
                callback(self.study, copy.deepcopy(self.storage.get_trial(trial_id)))

    def settled_keys(self) -> set[str]:
        """:func:`~planner.study.candidates.plan_key` of plans not to measure again in this study.

        Measured (COMPLETE), being measured by another job (RUNNING), or
        failed on a rank (FAIL with :attr:`FailKind.ERROR`). Plans whose
        trial was interrupted or went stale are measured again.
        """
        with self._storage_errors():
            trials = self.study.get_trials(deepcopy=False)
        keys = set()
        for t in trials:
            r = MeasuredTrialRecord.from_trial(t)
            settled = r.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING) or (
                r.state == optuna.trial.TrialState.FAIL and r.failure is not None and r.failure.kind == FailKind.ERROR)
            if r.plan_key and settled:
                keys.add(r.plan_key)
        return keys

    def interrupted(self, exclude: set[str]) -> list[Candidate]:
        """The plans of trials a stopping job failed as interrupted, to measure again, best predicted first.

        A job that stops for any reason but SIGKILL records the trials it held
        FAIL :attr:`FailKind.INTERRUPTED` (:meth:`fail_held`, the rank
        protocol's failed round); unlike a stale trial, Optuna does not re-queue
        them. A plan comes back while no trial settled it since (its
        :func:`~planner.study.candidates.plan_key` not in ``exclude``: see
        :meth:`settled_keys`) and it was interrupted at most ``[study]
        max_retry + 1`` times, the bound Optuna's retry callback puts on a stale
        plan. FSDP2's default never comes back this way: every round measures
        it. A trial whose parameters no longer build a plan for this profile is
        left out.
        """
        with self._storage_errors():
            trials = self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,))
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
            if key in exclude or times[key] > self.config.study.max_retry + 1:
                continue
            try:
                plan = self.space.build(t.params, self.profile)
            except SpaceParamsError:
                continue
            if plan_key(plan) != key or plan.is_default_for(self.profile):
                continue  # the parameters build another plan for this profile: not the one interrupted
            result = self.simulator.run(plan)
            out.append(Candidate(dict(t.params), dict(t.distributions), plan, result.step_ms, result.peak_bytes))
        return sorted(out, key=lambda c: c.predicted_ms)

    def recommendation(self) -> BestPlan:
        """The study's recommendation for this profile's model and world size, read on the storage this stage holds.

        Raises:
            StudyNotFoundError: no job of the study has concluded for this model and world size.
            StorageError: the storage cannot be read.
        """
        from planner.errors import StudyNotFoundError
        from planner.study.queries import best_in

        with self._storage_errors():
            best = best_in(self.storage, self.study, self.config.name, self.profile.fingerprint)
        if best is None:
            raise StudyNotFoundError(f"study {self.config.name!r} has no concluded tuning job for this model yet")
        return best

    def recommended(self) -> Candidate | None:
        """The study's recommendation for this profile's model and world size, or its pending plan, as a candidate
        to race again ([Note: One recommendation, re-confirmed by every job]); ``None`` when it is FSDP2's default
        with nothing pending, there is none yet, or its plan no longer builds for this profile."""
        from planner.study.queries import best_in

        with self._storage_errors():
            best = best_in(self.storage, self.study, self.config.name, self.profile.fingerprint)
            if best is None:
                return None
            held = best.recommendation.pending if best.keeps_baseline else best.recommendation.trial
            if held is None:
                return None
            trial = self.study.trials[held.number]
        try:
            plan = self.space.build(trial.params, self.profile)
        except SpaceParamsError:
            return None
        result = self.simulator.run(plan)
        return Candidate(dict(trial.params), dict(trial.distributions), plan, result.step_ms, result.peak_bytes,
                         reconfirms=trial.number)

    def records(self) -> list[MeasuredTrialRecord]:
        """Every trial of the study as a record, late confirmations included (``queries.measured_records``)."""
        from planner.study.queries import measured_records

        with self._storage_errors():
            return measured_records(self.storage, self.study)

    def ask(self, candidates: list[Candidate]) -> list[MeasuredTrial]:
        """Create one RUNNING trial per candidate, with its parameters and prediction."""
        out = []
        with self._storage_errors():
            for c in candidates:
                record = MeasuredTrialRecord(predicted_ms=c.predicted_ms, predicted_peak_bytes=c.predicted_peak_bytes,
                                             is_default=c.plan.is_default_for(self.profile), plan_key=plan_key(c.plan),
                                             user_plan=c.user_plan or None, job=self.job, source=self.source,
                                             reconfirms=c.reconfirms, predicted_for=c.predicted_for)
                template = optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING, params=c.params,
                                                     distributions=c.distributions, user_attrs=record.to_user_attrs())
                trial_id = self.storage.create_new_trial(self.study_id, template_trial=template)
                self.heartbeat.add(trial_id)
                number = self.storage.get_trial_number_from_id(trial_id)
                out.append(MeasuredTrial(number, trial_id, c.plan, c.predicted_ms, c.predicted_peak_bytes,
                                         reconfirms=c.reconfirms, user_plan=c.user_plan))
        return out

    def mark_baseline(self, asked: list[MeasuredTrial]) -> None:
        """Record which of the round's trials is its baseline (the first) and which are not (trial attribute
        ``baseline``): a re-queued trial carries the flag of the job that first asked it."""
        with self._storage_errors():
            for j, a in enumerate(asked):
                self._record(a.trial_id, MeasuredTrialRecord(baseline=j == 0))

    def tell(self, asked: list[MeasuredTrial], measured: list[MeasuredPlan], step_ms: list[list[float]],
             per_rank: list[list[list[float]]]) -> None:
        """Store the measured plans and their steps, then tell each trial its figures and its race median.

        The steps are stored once, in ``planner_measured_runs`` (:func:`planner.storages.archive.measured_steps`
        reads them back), and a confirmation once, in ``planner_confirmations``; the trial carries the figures made
        from them.

        Args:
            asked: the round's trials.
            measured: per trial, its plan (provenance filled in) and record
                (:func:`planner.study.provenance.measured_plans`).
            step_ms: per trial, every step's max across ranks, ms.
            per_rank: per trial, per rank, that rank's step times, ms.
        """
        # Each figure in one store: the plan as measured in planner_plans, its steps in planner_measured_runs, its
        # confirmation in planner_confirmations (where fresh launches add theirs after the trial finished), and the
        # figures made from them on the trial.
        plans = [with_confirmation(m.plan, None) for m in measured]
        with self._storage_errors():
            # Our rows first, then Optuna's state: a reader that sees a COMPLETE trial finds its plan and verdict.
            save_measured_plans(self.storage.engine, self.config.name, self.profile_id, plans,
                                [p.is_default_for(self.profile) for p in plans], step_ms, per_rank,
                                [m.record.confirmation_rows() for m in measured])
            for a, m in zip(asked, measured, strict=True):
                self._record(a.trial_id, m.record)
                self.study.tell(a.number, m.objective_ms, skip_if_finished=True)  # a stale FAIL stays
                self.heartbeat.discard(a.trial_id)

    def fail(self, asked: list[MeasuredTrial], failure: Failure, measured_peak_bytes: int | None = None) -> None:
        """Record every still-RUNNING trial of ``asked`` as FAIL.

        Args:
            failure: the one-line reason, and whether the plan is measured again
                (:class:`~planner.errors.FailKind`).
            measured_peak_bytes: the peak that failed it, stored with it.
        """
        with self._storage_errors():
            for a in asked:
                if measured_peak_bytes is not None:
                    self._record(a.trial_id, MeasuredTrialRecord(measured_peak_bytes=measured_peak_bytes))
                self._fail_one(a.number, a.trial_id, failure)

    def fail_held(self, reason: str, kind: FailKind = FailKind.INTERRUPTED) -> list[int]:
        """Record as FAIL every trial this stage still holds RUNNING (claimed or asked, not yet told).

        The last word of a job that stops for any reason (an interrupt that
        came before the round's trials were handed out, a storage error):
        none of its trials is left RUNNING for the next job to wait out.

        Returns:
            The trial numbers failed.
        """
        numbers = []
        with self._storage_errors():
            for trial_id in self.heartbeat.held():
                number = self.storage.get_trial_number_from_id(trial_id)
                if self._fail_one(number, trial_id, Failure(reason, kind)):
                    numbers.append(number)
        return numbers

    def _fail_one(self, number: int, trial_id: int, failure: Failure) -> bool:
        """FAIL the trial if it is still RUNNING; whether it was."""
        self.heartbeat.discard(trial_id)
        if self.storage.get_trial(trial_id).state != optuna.trial.TrialState.RUNNING:
            return False
        self._record(trial_id, MeasuredTrialRecord(failure=failure))
        self.study.tell(number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        return True

    def save_calibration(self, profile: Profile) -> None:
        """Store the calibrated profile in this run's profile row."""
        with self._storage_errors():
            update_profile(self.storage.engine, self.profile_id, profile)

    def close(self) -> None:
        """Stop the heartbeat thread (trials still held stay RUNNING until stale: see :meth:`fail_held`)."""
        self.heartbeat.stop()

