"""Questions asked of a study database: which studies, which trials, the best plan.

Every function opens the storage once (:func:`planner.storages.open_storage`)
and reads Optuna's tables and the planner's through that one engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import optuna

from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.plan import Plan
from planner.errors import StudyNotFoundError
from planner.statistics.verdict import Verdict, confirmation_text
from planner.storages import check_exists, open_storage, open_storage_read_only
from planner.storages.archive import stored_plan
from planner.study.records import MeasuredTrialRecord, SimulatedTrialRecord
from planner.study.simulated import SIM_SUFFIX, complete_trials


@dataclass(frozen=True)
class StudyOverview:
    """One study of a database, as ``studies list`` shows it.

    Attributes:
        name: the study's name (its measured study; ``name.sim`` holds the simulated trials).
        measured_trial_count: trials of the measured study, in every state.
        simulated_trial_count: trials of the simulated study.
        best_ms: the lowest measured step time, ms (``None`` before any).
        default_ms: FSDP2's default's latest measured step time, ms.
    """

    name: str
    measured_trial_count: int
    simulated_trial_count: int
    best_ms: float | None
    default_ms: float | None


def _open_existing(url: str) -> optuna.storages.RDBStorage:
    check_exists(url)
    return open_storage(url)


def _load(url: str, name: str, read_only: bool = False) -> tuple[optuna.Study, optuna.storages.RDBStorage]:
    storage = open_storage_read_only(url) if read_only else _open_existing(url)
    try:
        return optuna.load_study(study_name=name, storage=storage), storage
    except KeyError:
        names = sorted(n for n in optuna.get_all_study_names(storage) if not n.endswith(SIM_SUFFIX))
        raise StudyNotFoundError(
            f"no study {name!r} in {url}; studies there: {', '.join(names) or 'none'}"
        ) from None


def list_studies(url: str) -> list[StudyOverview]:
    """Every measured study in the storage at ``url``.

    Raises:
        StudyNotFoundError: a SQLite file that does not exist.
        StorageError: the storage cannot be opened.
    """
    storage = _open_existing(url)
    names = optuna.get_all_study_names(storage)
    out = []
    for name in sorted(n for n in names if not n.endswith(SIM_SUFFIX)):
        study = optuna.load_study(study_name=name, storage=storage)
        done = complete_trials(study)
        sim_count = 0
        if name + SIM_SUFFIX in names:
            sim_count = len(optuna.load_study(study_name=name + SIM_SUFFIX, storage=storage).trials)
        defaults = [t.value for t in done if MeasuredTrialRecord.from_trial(t).is_default]
        out.append(StudyOverview(
            name, len(study.trials), sim_count,
            min((t.value for t in done), default=None), defaults[-1] if defaults else None,
        ))
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
    study, storage = _load(url, name)
    measured = [MeasuredTrialRecord.from_trial(t) for t in study.trials]
    try:
        sim = optuna.load_study(study_name=name + SIM_SUFFIX, storage=storage)
    except KeyError:
        sim = None
    return StudyTrials(measured, [SimulatedTrialRecord.from_trial(t) for t in (sim.trials if sim else [])])


class BestPlan(NamedTuple):
    """A study's answer to "which plan should I train with?".

    Attributes:
        plan: the plan confirmed faster than FSDP2's default with the lowest
            ratio (ties to the lower trial); FSDP2's default's own stored plan
            when no plan is confirmed faster.
        default_ms: FSDP2's default's latest race median, ms.
        closest: when no plan is confirmed faster, the confirmed candidate
            with the lowest ratio (its provenance has the verdict and
            interval); else ``None``.
    """

    plan: Plan
    default_ms: float | None
    closest: Plan | None


def _stored_plan(storage: optuna.storages.RDBStorage, name: str, number: int) -> Plan:
    plan = stored_plan(storage.engine, name, number)
    if plan is None:
        raise StudyNotFoundError(f"study {name!r} trial {number} has no stored plan")
    return plan


def confirmed_trials(study: optuna.Study) -> list[MeasuredTrialRecord]:
    """COMPLETE trials with a confirmation, confirmed faster first, then by ratio and trial number."""
    confirmed = [r for r in map(MeasuredTrialRecord.from_trial, complete_trials(study)) if r.confirmation is not None]
    return sorted(confirmed, key=lambda r: (r.verdict != Verdict.FASTER, r.confirmation.ratio, r.number))


def best_plan(url: str, name: str) -> BestPlan:
    """The plan study ``name`` recommends: the best confirmed faster than FSDP2's default, else the default.

    Raises:
        StudyNotFoundError: no such study, or no measured plan in it yet.
    """
    study, storage = _load(url, name)
    done = complete_trials(study)
    if not done:
        raise StudyNotFoundError(f"study {name!r} has no measured trial yet; run `prefetch-planner tune` on it")
    defaults = [t for t in done if MeasuredTrialRecord.from_trial(t).is_default]
    default_ms = defaults[-1].value if defaults else None
    confirmed = confirmed_trials(study)
    if confirmed and confirmed[0].verdict == Verdict.FASTER:
        return BestPlan(_stored_plan(storage, name, confirmed[0].number), default_ms, None)
    if not defaults:
        raise StudyNotFoundError(f"study {name!r} has no measurement of FSDP2's default to recommend")
    closest = _stored_plan(storage, name, confirmed[0].number) if confirmed else None
    return BestPlan(_stored_plan(storage, name, defaults[-1].number), default_ms, closest)


def best_plan_for(url: str, name: str, fingerprint: Fingerprint) -> tuple[Plan | None, str]:
    """The best plan of study ``name`` confirmed faster than FSDP2's default and made for ``fingerprint``.

    Reads through :func:`planner.storages.open_storage_read_only`: nothing is
    written, tables included.

    Returns:
        ``(plan, why)``: the plan (``None`` if there is none) and one line
        saying which plan it is or why there is none.

    Raises:
        StudyNotFoundError: no database or no such study.
        StorageError: the storage cannot be opened.
    """
    study, storage = _load(url, name, read_only=True)
    try:
        faster = [t for t in confirmed_trials(study) if t.verdict == Verdict.FASTER]
        if not faster:
            return None, f"study {name!r} has no plan confirmed faster than FSDP2's default"
        differences = []
        for t in faster:
            plan = _stored_plan(storage, name, t.number)
            difference = plan.fingerprint.first_difference(fingerprint)
            if difference is None:
                pv = plan.provenance
                return plan, (f"trial {t.number} of study {name!r}, faster than FSDP2's default: "
                              f"{confirmation_text(pv.measured_ratio, pv.ratio_ci95, pv.rounds)}")
            differences.append(f"trial {t.number}: {difference}")
        return None, (f"study {name!r} has {len(faster)} plan(s) confirmed faster, none made for this model and "
                      f"world size ({differences[0]})")
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
