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
measured or are measuring (what earlier jobs left, stale trials re-queued and
plans interrupted: :class:`planner.study.earlier_jobs.EarlierJobs`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import optuna

from planner.artifacts.config import StudyConfig
from planner.artifacts.plan import Plan
from planner.artifacts.profile import Profile
from planner.errors import FailKind
from planner.simulation.simulator import Simulator
from planner.storages import storage_errors
from planner.storages.archive import save_measured_plans, save_profile, update_profile
from planner.study.candidates import Candidate, plan_key
from planner.study.heartbeat import Heartbeat
from planner.study.provenance import OBJECTIVE, MeasuredPlan, as_stored
from planner.study.records import Failure, MeasuredTrialRecord, StudyRecord
from planner.study.search_space import SearchSpace
from planner.study.simulated import name_objective

if TYPE_CHECKING:
    pass


def job_name() -> str:
    """A new tuning job's name: host, process id and a random suffix (trial attribute ``job``)."""
    import os
    import socket
    import uuid

    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class MeasuredTrial:
    """A RUNNING trial of the measured study and the candidate it measures.

    Attributes:
        number: the Optuna trial number.
        trial_id: the storage's trial id (heartbeats).
        candidate: what it measures: the plan, built from the trial's parameters for this profile, and its
            prediction and marks (:class:`~planner.study.candidates.Candidate`).
        retry_of: for a re-queued stale trial, the number of the trial first
            failed (Optuna's ``failed_trial`` system attribute), else ``None``.
    """

    number: int
    trial_id: int
    candidate: Candidate
    retry_of: int | None = None

    @property
    def plan(self) -> Plan:
        """The plan it measures (the candidate's)."""
        return self.candidate.plan

    def is_baseline(self, profile: Profile, users: bool) -> bool:
        """Whether it is the round's baseline: the plan the model arrived with where the model had one (``users``),
        else FSDP2's default for ``profile``."""
        return self.candidate.user_plan if users else self.plan.is_default_for(profile)


class MeasuredStage:
    """The trials of study ``NAME`` one job creates, holds and tells.

    One job's round: what earlier jobs left (``EarlierJobs``: stale trials
    re-queued and claimed, plans settled or interrupted), :meth:`ask` (one
    RUNNING trial per candidate, heartbeat on), then
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
        with self.storage_errors():
            self.study = optuna.create_study(
                study_name=config.name, storage=storage, direction="minimize", load_if_exists=True
            )
            for key, value in StudyRecord(space.name).to_user_attrs().items():
                self.study.set_user_attr(key, value)
            name_objective(self.study, OBJECTIVE)  # optuna-dashboard's label for the trials' value
            self.study_id = storage.get_study_id_from_name(config.name)
            self.profile_id = save_profile(storage.engine, config.name, self.profile)
        self.heartbeat = Heartbeat(storage, config.study.heartbeat_interval_s)

    def storage_errors(self) -> contextlib.AbstractContextManager[None]:
        """Storage errors raised as ``StorageError`` naming the study's storage."""
        return storage_errors(self.config.storage_url)

    def record(self, trial_id: int, record: MeasuredTrialRecord) -> None:
        """Store ``record``'s attributes on the trial."""
        for key, value in record.to_user_attrs().items():
            self.storage.set_trial_user_attr(trial_id, key, value)

    def records(self) -> list[MeasuredTrialRecord]:
        """Every trial of the study as a record, late confirmations included (``queries.measured_records``)."""
        from planner.study.queries import measured_records

        with self.storage_errors():
            return measured_records(self.storage, self.study)

    def ask(self, candidates: list[Candidate]) -> list[MeasuredTrial]:
        """Create one RUNNING trial per candidate, with its parameters and prediction."""
        out = []
        with self.storage_errors():
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
                out.append(MeasuredTrial(number, trial_id, c))
        return out

    def mark_baseline(self, asked: list[MeasuredTrial]) -> None:
        """Record which of the round's trials is its baseline (the first) and which are not (trial attribute
        ``baseline``): a re-queued trial carries the flag of the job that first asked it."""
        with self.storage_errors():
            for j, a in enumerate(asked):
                self.record(a.trial_id, MeasuredTrialRecord(baseline=j == 0))

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
        # Each figure in one store: the plan as measured in planner_plans (without the figures and the verdict), its
        # steps in planner_measured_runs, its confirmation in planner_confirmations (where fresh launches add theirs
        # after the trial finished), and its prediction and the figures made from its steps on the trial.
        plans = [as_stored(m.plan) for m in measured]
        with self.storage_errors():
            # Our rows first, then Optuna's state: a reader that sees a COMPLETE trial finds its plan and verdict.
            save_measured_plans(self.storage.engine, self.config.name, self.profile_id, plans,
                                [p.is_default_for(self.profile) for p in plans], step_ms, per_rank,
                                [m.record.confirmation_rows() for m in measured])
            for a, m in zip(asked, measured, strict=True):
                self.record(a.trial_id, m.record)
                self.study.tell(a.number, m.objective_ms, skip_if_finished=True)  # a stale FAIL stays
                self.heartbeat.discard(a.trial_id)

    def fail(self, asked: list[MeasuredTrial], failure: Failure, measured_peak_bytes: int | None = None) -> None:
        """Record every still-RUNNING trial of ``asked`` as FAIL.

        Args:
            failure: the one-line reason, and whether the plan is measured again
                (:class:`~planner.errors.FailKind`).
            measured_peak_bytes: the peak that failed it, stored with it.
        """
        with self.storage_errors():
            for a in asked:
                if measured_peak_bytes is not None:
                    self.record(a.trial_id, MeasuredTrialRecord(measured_peak_bytes=measured_peak_bytes))
                self.fail_one(a.number, a.trial_id, failure)

    def fail_held(self, reason: str, kind: FailKind = FailKind.INTERRUPTED) -> list[int]:
        """Record as FAIL every trial this stage still holds RUNNING (claimed or asked, not yet told).

        The last word of a job that stops for any reason (an interrupt that
        came before the round's trials were handed out, a storage error):
        none of its trials is left RUNNING for the next job to wait out.

        Returns:
            The trial numbers failed.
        """
        numbers = []
        with self.storage_errors():
            for trial_id in self.heartbeat.held():
                number = self.storage.get_trial_number_from_id(trial_id)
                if self.fail_one(number, trial_id, Failure(reason, kind)):
                    numbers.append(number)
        return numbers

    def fail_one(self, number: int, trial_id: int, failure: Failure) -> bool:
        """FAIL the trial if it is still RUNNING; whether it was."""
        self.heartbeat.discard(trial_id)
        if self.storage.get_trial(trial_id).state != optuna.trial.TrialState.RUNNING:
            return False
        self.record(trial_id, MeasuredTrialRecord(failure=failure))
        self.study.tell(number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        return True

    def save_calibration(self, profile: Profile) -> None:
        """Store the calibrated profile in this run's profile row."""
        with self.storage_errors():
            update_profile(self.storage.engine, self.profile_id, profile)

    def close(self) -> None:
        """Stop the heartbeat thread (trials still held stay RUNNING until stale: see :meth:`fail_held`)."""
        self.heartbeat.stop()

