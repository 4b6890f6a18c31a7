"""Questions asked of a study database: which studies, which trials, the best plan.

Every function opens the storage once (:func:`planner.storages.open_storage`)
and reads Optuna's tables and the planner's through that one engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import optuna

from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.plan import Plan, Provenance, baseline_name
from planner.errors import StudyNotFoundError
from planner.statistics.looks import MAX_LAUNCHES
from planner.statistics.verdict import Confirmation, Verdict, confirmation_text
from planner.storages import check_exists, open_storage, open_storage_read_only
from planner.storages.archive import MeasuredSteps, confirmation_rows, measured_steps, stored_plan
from planner.study.predicted import PREDICTED_SUFFIX
from planner.study.provenance import as_measured
from planner.study.recommendation import JobVerdict, Recommendation, recommend
from planner.study.records import MeasuredTrialRecord, SimulatedTrialRecord
from planner.study.simulated import SIM_SUFFIX


@dataclass(frozen=True)
class StudyOverview:
    """One study of a database, as ``studies list`` shows it.

    Attributes:
        name: the study's name (its measured study; ``name.sim`` holds the simulated trials).
        measured_trial_count: trials of the measured study, in every state.
        simulated_trial_count: trials of the simulated study.
        recommended_trial: the trial of the plan the study recommends (:func:`best_plan`); ``None`` before any
            job concluded.
        default_ms: the baseline's race median in the job that decided it (FSDP2's default, or the plan the model
            arrived with), ms.
        confirmation: that job's confirmation of the recommended plan, or of its pending plan (``None`` when it
            recommends the baseline with nothing pending).
        pending_trial: the trial of the plan that waits on more launches, not applied (provisional, or confirmed
            faster before the total-time estimand); ``None`` if none.
    """

    name: str
    measured_trial_count: int
    simulated_trial_count: int
    recommended_trial: int | None
    default_ms: float | None
    confirmation: Confirmation | None
    pending_trial: int | None = None


def _open_existing(url: str) -> optuna.storages.RDBStorage:
    check_exists(url)
    return open_storage(url)


def load_study(url: str, name: str, read_only: bool = False) -> tuple[optuna.Study, optuna.storages.RDBStorage]:
    """Study ``name`` at ``url`` and its storage (``read_only``: opened so nothing is written).

    Raises:
        StudyNotFoundError: no database at ``url``, or no such study (the message lists the studies there).
        StorageError: the storage cannot be opened.
    """
    storage = open_storage_read_only(url) if read_only else _open_existing(url)
    try:
        return optuna.load_study(study_name=name, storage=storage), storage
    except KeyError:
        names = sorted(n for n in optuna.get_all_study_names(storage)
                       if not n.endswith((SIM_SUFFIX, PREDICTED_SUFFIX)))
        raise StudyNotFoundError(
            f"no study {name!r} in {url}; studies there: {', '.join(names) or 'none'}"
        ) from None


def measured_records(storage: optuna.storages.RDBStorage, study: optuna.Study) -> list[MeasuredTrialRecord]:
    """Every trial of the measured ``study`` as a record, with its confirmation's launches and verdict
    (``planner.storages.archive.confirmation_rows``)."""
    rows = confirmation_rows(storage.engine, study.study_name)
    out = []
    for t in study.get_trials(deepcopy=False):
        r = MeasuredTrialRecord.from_trial(t)
        out.append(r.with_confirmation_rows(*rows[t.number]) if t.number in rows else r)
    return out


@dataclass(frozen=True)
class TrialView:
    """One trial of a measured study, read whole (:func:`read_trial`).

    Attributes:
        record: what the trial carries (parameters, prediction, race figures, failure), its confirmation's launches
            and verdict included (``planner_confirmations``: :func:`measured_records`).
        plan: the plan as measured (``planner_plans``), its provenance's figures and verdict read from the trial
            (``provenance.as_measured``); ``None``: not measured (a trial that failed or is running).
        steps: each round it was measured in, every step's time, ms (``planner_measured_runs``); empty: none.
    """

    record: MeasuredTrialRecord
    plan: Plan | None
    steps: list[MeasuredSteps]


def read_trial(url: str, name: str, number: int) -> TrialView:
    """Trial ``number`` of the measured study ``name`` at ``url``, read whole in one call: its record, its verdict,
    its plan and its steps, each from the one table that stores it (docs/studies.md, "Querying a study with SQL").
    Opened read-only.

    Raises:
        StudyNotFoundError: no such study, or no trial ``number`` in it.
        StorageError: the storage cannot be opened.
    """
    study, storage = load_study(url, name, read_only=True)
    records = measured_records(storage, study)
    record = next((r for r in records if r.number == number), None)
    if record is None:
        raise StudyNotFoundError(f"study {name!r} has no trial {number}; `prefetch-planner studies show {name}` "
                                 "lists its trials")
    stored = stored_plan(storage.engine, name, number)
    baseline = next((r for r in reversed(records) if r.job == record.job and r.is_baseline), None)
    return TrialView(record, None if stored is None else as_measured(stored, record, baseline),
                     [s for s in measured_steps(storage.engine, name) if s.trial == number])


def list_studies(url: str) -> list[StudyOverview]:
    """Every measured study in the storage at ``url``.

    Raises:
        StudyNotFoundError: a SQLite file that does not exist.
        StorageError: the storage cannot be opened.
    """
    storage = _open_existing(url)
    names = optuna.get_all_study_names(storage)
    out = []
    for name in sorted(n for n in names if not n.endswith((SIM_SUFFIX, PREDICTED_SUFFIX))):
        study = optuna.load_study(study_name=name, storage=storage)
        sim_count = 0
        if name + SIM_SUFFIX in names:
            sim_count = len(optuna.load_study(study_name=name + SIM_SUFFIX, storage=storage).trials)
        r = recommend(measured_records(storage, study))
        if r is None:
            out.append(StudyOverview(name, len(study.trials), sim_count, None, None, None))
        else:
            shown = r.confirmation if not r.keeps_baseline or r.pending is not None else None
            out.append(StudyOverview(name, len(study.trials), sim_count, r.trial.number, r.baseline_ms, shown,
                                     r.pending.number if r.pending is not None else None))
    return out


@dataclass(frozen=True)
class StudyTrials:
    """Every trial of a study, as typed records.

    Attributes:
        measured: the trials of study ``NAME``, by number (:class:`MeasuredTrialRecord`).
        simulated: the trials of ``NAME.sim``, by number (:class:`SimulatedTrialRecord`).
    """

    measured: list[MeasuredTrialRecord]
    simulated: list[SimulatedTrialRecord]


def study_trials(url: str, name: str) -> StudyTrials:
    """Every trial of study ``name``, measured and simulated.

    Raises:
        StudyNotFoundError: no such study.
    """
    study, storage = load_study(url, name)
    measured = measured_records(storage, study)
    try:
        sim = optuna.load_study(study_name=name + SIM_SUFFIX, storage=storage)
    except KeyError:
        sim = None
    return StudyTrials(measured, [SimulatedTrialRecord.from_trial(t) for t in (sim.trials if sim else [])])


@dataclass(frozen=True)
class BestPlan:
    """A study's answer to "which plan should I train with?" ([Note: One recommendation, re-confirmed by every job]).

    Attributes:
        plan: the recommended plan: the deciding job's survivor confirmed faster than its baseline across
            processes, else that baseline's own stored plan (FSDP2's default, or the plan the model arrived with).
        recommendation: which trial, which job, and that job's figures.
        survivor: the deciding job's survivor when it was not confirmed faster (its provenance has the verdict;
            a provisional one is the study's pending plan), else ``None``.
    """

    plan: Plan
    recommendation: Recommendation
    survivor: Plan | None

    @property
    def keeps_baseline(self) -> bool:
        """Whether the study recommends its deciding job's baseline: FSDP2's default, or the plan the model arrived
        with (:meth:`baseline_name`), nothing confirmed faster than it."""
        return self.recommendation.keeps_baseline

    def baseline_name(self) -> str:
        """What the deciding job's verdicts compare against, in words."""
        return baseline_name(self.recommendation.baseline_is_users)

    def line(self, study: str) -> str:
        """One line: which plan, and the confirmed figures it rests on (``tune``, ``studies best``,
        ``load_best_plan``)."""
        r = self.recommendation
        job = f"job {r.job.job}" if r.job.job else "the latest job"
        base = self.baseline_name()
        if not self.keeps_baseline:
            return f"trial {r.trial.number} of study {study!r}, confirmed faster than {base} by {job}: " + (
                provenance_text(self.plan.provenance))
        if self.survivor is None:
            return f"{base}: every candidate of {job} was significantly slower in its race"
        pv = self.survivor.provenance
        if r.pending is not None:
            why = ("PROVISIONAL: faster in its launches, not yet across processes" if pv.verdict == Verdict.PROVISIONAL
                   else "confirmed faster before the total-time estimand, from one process")
            return (f"{base}, while {job}'s survivor, trial {pv.trial}, is {why} ({provenance_text(pv)}); "
                    f"it is applied once the in-loop tuner's next start or a later job confirms it faster "
                    f"(fresh launch {r.pending.confirmation.fresh_launches + 1} of up to {MAX_LAUNCHES})")
        return (f"{base}: {job} confirmed no plan faster (its survivor, trial {pv.trial}: {pv.verdict}, "
                f"{provenance_text(pv)})")


def provenance_text(pv: Provenance) -> str:
    """A plan's confirmed figures: :func:`~planner.statistics.verdict.confirmation_text` of its provenance."""
    return confirmation_text(pv.measured_ratio, pv.ratio_ci95, pv.rounds, pv.launches or 1,
                             total_time=pv.ratio_of == "total time")


def _stored_plan(storage: optuna.storages.RDBStorage, name: str, record: MeasuredTrialRecord,
                 job: JobVerdict) -> Plan:
    """The plan stored for ``record``'s trial of ``job``, with the figures and the verdict its trial stores
    (``provenance.as_measured``)."""
    plan = stored_plan(storage.engine, name, record.number)
    if plan is None:
        raise StudyNotFoundError(f"study {name!r} trial {record.number} has no stored plan")
    return as_measured(plan, record, job.baseline)


def best_in(storage: optuna.storages.RDBStorage, study: optuna.Study, name: str,
            fingerprint: Fingerprint | None) -> BestPlan | None:
    """The recommendation of ``study`` (opened on ``storage``) for ``fingerprint`` (any, if ``None``); ``None`` when
    no job concluded."""
    records = measured_records(storage, study)

    def matches(verdict: JobVerdict) -> bool:
        if fingerprint is None:
            return True
        plan = stored_plan(storage.engine, name, verdict.baseline.number)
        return plan is not None and plan.fingerprint.first_difference(fingerprint) is None

    r = recommend(records, matches)
    if r is None:
        return None
    survivor = r.job.survivor
    return BestPlan(_stored_plan(storage, name, r.trial, r.job), r,
                    _stored_plan(storage, name, survivor, r.job) if survivor is not None and r.keeps_baseline else None)


def best_plan(url: str, name: str, fingerprint: Fingerprint | None = None) -> BestPlan:
    """The plan study ``name`` recommends (for ``fingerprint``'s model and world size, if given).

    Raises:
        StudyNotFoundError: no such study, or no job of it has concluded (for that fingerprint).
    """
    study, storage = load_study(url, name)
    best = best_in(storage, study, name, fingerprint)
    if best is None:
        raise StudyNotFoundError(f"study {name!r} has no concluded tuning job yet; run `prefetch-planner tune` on it")
    return best


def best_plan_for(url: str, name: str, fingerprint: Fingerprint) -> tuple[Plan | None, str]:
    """The plan study ``name`` recommends for ``fingerprint``, if it is not the baseline (``load_best_plan``): a
    model that keeps its baseline keeps what it has, FSDP2's default or the plan it arrived with.

    Reads through :func:`planner.storages.open_storage_read_only`: nothing is
    written, tables included.

    Returns:
        ``(plan, why)``: the plan (``None`` when the study recommends the baseline, or has no concluded job for
        this model and world size) and one line saying which plan it is or why there is none.

    Raises:
        StudyNotFoundError: no database or no such study.
        StorageError: the storage cannot be opened.
    """
    best = recommendation_for(url, name, fingerprint)
    if best is None:
        return None, f"study {name!r} has no concluded tuning job for this model and world size"
    return (None if best.keeps_baseline else best.plan), best.line(name)


def recommendation_for(url: str, name: str, fingerprint: Fingerprint) -> BestPlan | None:
    """Study ``name``'s recommendation for ``fingerprint`` (:func:`best_in`), read-only; ``None`` when no job for
    this model and world size concluded.

    Raises:
        StudyNotFoundError: no database or no such study.
        StorageError: the storage cannot be opened.
    """
    study, storage = load_study(url, name, read_only=True)
    try:
        return best_in(storage, study, name, fingerprint)
    finally:
        storage.engine.dispose()


def pareto_front(trials: list[SimulatedTrialRecord]) -> list[SimulatedTrialRecord]:
    """The simulated trials no other beats on both predicted step and peak, by peak ascending.

    One trial per distinct point (the earliest); trials without both figures are left out.
    """
    out: list[SimulatedTrialRecord] = []
    best_ms = float("inf")
    known = [t for t in trials if t.predicted_ms is not None and t.predicted_peak_bytes is not None]
    for t in sorted(known, key=lambda t: (t.predicted_peak_bytes, t.predicted_ms, t.number)):
        if t.predicted_ms < best_ms:
            out.append(t)
            best_ms = t.predicted_ms
    return out
