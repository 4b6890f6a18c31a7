"""The confirmation in fresh launches: the race's survivor against its job's baseline, in new processes.

A tuning job's race ends with a survivor whose trial carries the rounds each
confirmation launch runs (``confirm_rounds``). Each launch (``prefetch-planner
confirm``, started by ``tune`` after its ranks exit) builds the model afresh,
applies the two plans from the first step, and appends its rounds to the
trial (:func:`record_launch`). Once the launches ran, :func:`conclude` turns
them into one confirmation with any earlier launches of the same
recommendation ([Note: Between-launch spread]), stores it
on the trial and its plan, and writes the study's recommendation
(:func:`planner.study.queries.best_plan`) to the plan file. Torch-free: the
tests drive it with synthetic launches.
"""

from __future__ import annotations

from dataclasses import dataclass

import optuna

from planner.artifacts.config import StudyConfig
from planner.artifacts.plan import Plan
from planner.errors import StudyNotFoundError
from planner.statistics.design import ConfirmDesign
from planner.statistics.launches import DEFAULT_SPREAD
from planner.statistics.looks import Looks
from planner.statistics.verdict import Confirmation, confirm_launches, power, step_noise_pct
from planner.storages import open_storage, storage_errors
from planner.storages.archive import confirmation_rows, save_confirmation_row, stored_plan
from planner.study.candidates import plan_key
from planner.study.cluster_spread import ClusterKey, ClusterSpread, cluster_spread
from planner.study.evidence import chain_of, own_launches, study_spread
from planner.study.queries import BestPlan, best_plan, measured_records
from planner.study.recommendation import JobVerdict, job_verdicts
from planner.study.records import ConfirmLaunch, confirmation_attrs


@dataclass(frozen=True)
class PendingConfirmation:
    """A job's survivor waiting for its confirmation launches.

    Attributes:
        survivor, baseline: the survivor's and its job's baseline's stored plans (FSDP2's default, or the plan the
            model arrived with; provenance: their trials).
        rounds: rounds per launch.
        launches: launches measured so far.
        planned: the launches its confirmation's design asked for at the race's end; ``None`` on trials written
            before designs.
        sigma: the race's per-round log-ratio noise (``nan``: not stored).
    """

    survivor: Plan
    baseline: Plan
    rounds: int
    launches: int
    planned: int | None = None
    sigma: float = float("nan")


def _study(config: StudyConfig) -> tuple[optuna.Study, optuna.storages.RDBStorage]:
    storage = open_storage(config.storage_url, config)
    try:
        return optuna.load_study(study_name=config.name, storage=storage), storage
    except KeyError:
        raise StudyNotFoundError(f"no study {config.name!r} in {config.storage_url}") from None


def _job(config: StudyConfig, job: str) -> tuple[JobVerdict, optuna.Study, optuna.storages.RDBStorage]:
    """Job ``job``'s verdict, the study and its storage (call inside ``storage_errors``).

    Raises:
        StudyNotFoundError: no such study, or no job ``job`` in it that measured its baseline.
    """
    study, storage = _study(config)
    verdict = next((v for v in job_verdicts(measured_records(storage, study)) if v.job == job), None)
    if verdict is None:
        raise StudyNotFoundError(f"study {config.name!r} has no job {job!r} that measured its baseline")
    return verdict, study, storage


def pending(config: StudyConfig, job: str) -> PendingConfirmation | None:
    """Job ``job``'s survivor waiting for confirmation, ``None`` if the job has none (its race dropped every
    candidate, or it is confirmed already).

    Raises:
        StudyNotFoundError: no such study, or no job ``job`` in it that measured its baseline.
    """
    with storage_errors(config.storage_url):
        verdict, study, storage = _job(config, job)
        s = verdict.survivor
        if s is None or s.confirmation is not None or s.confirm_rounds is None:
            return None
        plans = [stored_plan(storage.engine, config.name, n) for n in (s.number, verdict.baseline.number)]
        if None in plans:
            raise StudyNotFoundError(f"study {config.name!r}: job {job!r} has no stored plan for trial {s.number}")
        sigma = s.race.ratio_sigma if s.race is not None and s.race.ratio_sigma is not None else float("nan")
        return PendingConfirmation(plans[0], plans[1], s.confirm_rounds, len(s.confirm_launches or []),
                                   s.confirm_planned, sigma)


def design_for(config: StudyConfig, waiting: PendingConfirmation) -> tuple[ConfirmDesign, ClusterSpread]:
    """The confirmation's size for a pending survivor, at the cluster's spread as it stands now (after a
    calibration the job ran: ``planner.statistics.design``), and that spread. A trial stored before designs keeps
    the rounds and the ``confirm_launches`` it was given.

    Raises:
        StorageError: the storage cannot be read.
    """
    with storage_errors(config.storage_url):
        study, storage = _study(config)
        cluster = _cluster(storage, config, waiting.baseline)
        records = measured_records(storage, study)
        spread = study_spread(records, plan_key(waiting.survivor), cluster.spread)
    settings = config.measure.confirm_settings(spread=spread, floor=cluster.floor)
    if waiting.sigma != waiting.sigma:  # an older trial: as it was sized
        launches = waiting.planned if waiting.planned is not None else config.measure.confirm_launches or 0
        looks = Looks(horizon=max(1, launches))
        found = power(max(1, launches), waiting.rounds, settings.resolve, float("nan"), spread, looks,
                      floor=cluster.floor)
        return ConfirmDesign(launches, waiting.rounds, max(1, launches), found, settings.resolve,
                             tau=max(cluster.floor, spread.tau)), cluster
    return settings.design(waiting.sigma), cluster


def record_launch(config: StudyConfig, trial: int, launch: ConfirmLaunch) -> int:
    """Append one launch's rounds to the survivor's trial; the launches it now has.

    Raises:
        StorageError: the database cannot be written.
    """
    with storage_errors(config.storage_url):
        study, storage = _study(config)
        save_confirmation_row(storage.engine, config.name, trial, launch=launch.to_json())
        return len(confirmation_rows(storage.engine, config.name)[trial][0])


def conclude(config: StudyConfig, job: str, plan_out: str,
             horizon: int | None = None) -> tuple[Confirmation | None, BestPlan]:
    """Confirm job ``job``'s survivor from its launches, store the verdict, write the study's recommendation.

    ``horizon``: the fresh launches its chain plans for when this is its first look (the design
    :func:`design_for` gave); ``None``: the trial's stored design, else its launches.

    Returns:
        The confirmation (``None`` when no launch measured it: the recommendation stays as it was), and the
        study's recommendation for the job's model and world size after it, written to ``plan_out``.

    Raises:
        StudyNotFoundError: no such job; or no launch measured its survivor and no earlier job concluded.
        PlannerError: the plan file cannot be written.
    """
    confirmation = None
    with storage_errors(config.storage_url):
        verdict, study, storage = _job(config, job)
        s = verdict.survivor
        baseline = stored_plan(storage.engine, config.name, verdict.baseline.number)
        if s is not None and s.confirmation is None and s.confirm_launches:
            launches = s.confirm_launches
            noise = step_noise_pct([x.plan_ms for x in launches] + [x.default_ms for x in launches])
            records = measured_records(storage, study)
            chain = chain_of({r.number: r for r in records}, s.reconfirms)
            looks = chain.looks if chain.launches else Looks(horizon=horizon or s.confirm_planned or len(launches))
            cluster = _cluster(storage, config, baseline)
            confirmation = confirm_launches([*chain.launches, *own_launches(s)], noise,
                                            study_spread(records, s.plan_key, cluster.spread), looks,
                                            cluster.spread)
            save_confirmation_row(storage.engine, config.name, s.number, confirmation=confirmation_attrs(confirmation))
    try:
        best = best_plan(config.storage_url, config.name, baseline.fingerprint if baseline is not None else None)
    except StudyNotFoundError:
        raise StudyNotFoundError(f"job {job!r}: no confirmation launch measured its race survivor, and no earlier "
                                 f"job of study {config.name!r} concluded; run `prefetch-planner tune` again") from None
    best.plan.to_json(plan_out)
    return confirmation, best


def _cluster(storage: optuna.storages.RDBStorage, config: StudyConfig, baseline: Plan | None) -> ClusterSpread:
    """The spread of the cluster the job ran on (its baseline's fingerprint, the study's backend)."""
    if baseline is None:  # no stored plan to read the cluster from: the most conservative prior
        return ClusterSpread(ClusterKey("cpu", str(config.launch.backend), 0), DEFAULT_SPREAD, False, "the CPU prior")
    return cluster_spread(storage.engine, ClusterKey.of(baseline.fingerprint, config.launch.backend))
