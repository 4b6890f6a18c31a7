"""Questions asked of a study database: which studies, which trials, the best plan, the latest calibration.

Every function opens the storage once (:func:`planner.storages.open_storage`)
and reads Optuna's tables and the planner's through that one engine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import optuna
import sqlalchemy as sa

from planner.errors import PlannerError, StudyNotFoundError
from planner.plan import Plan
from planner.profile import Profile
from planner.storages import PlanRow, ProfileRow, check_exists, open_storage, session
from planner.study.simulated import SIM_SUFFIX, complete_trials


class TrialStage(enum.StrEnum):
    """Which of a study's two Optuna studies a trial belongs to."""

    MEASURED = "measured"  # study NAME: a plan measured on the real ranks
    SIMULATED = "simulated"  # study NAME.sim: a plan the simulator predicted


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


def latest_calibration(storage: optuna.storages.RDBStorage, name: str, profile: Profile) -> dict[str, float] | None:
    """The newest calibration stored for study ``name`` on the same model and world as ``profile``, if any."""
    with session(storage.engine) as s:
        rows = s.scalars(
            sa.select(ProfileRow).where(ProfileRow.study_name == name).order_by(ProfileRow.id.desc())
        ).all()
    for row in rows:
        try:
            stored = Profile.from_json(row.json)
        except PlannerError:
            continue
        if stored.calibration and stored.fingerprint.first_difference(profile.fingerprint) is None:
            return stored.calibration
    return None


def _open_existing(url: str) -> optuna.storages.RDBStorage:
    check_exists(url)
    return open_storage(url)


def _load(url: str, name: str) -> tuple[optuna.Study, optuna.storages.RDBStorage]:
    storage = _open_existing(url)
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
        defaults = [t.value for t in done if t.user_attrs.get("is_default")]
        out.append(StudyOverview(
            name, len(study.trials), sim_count,
            min((t.value for t in done), default=None), defaults[-1] if defaults else None,
        ))
    return out


def study_trials(url: str, name: str) -> list[dict[str, Any]]:
    """Trials of study ``name``: measured ones, then simulated ones.

    Each row: ``stage`` (:class:`TrialStage`), ``number``, ``state``,
    ``predicted_ms``, ``measured_ms``, ``is_default``, ``params``; measured
    rows also ``job``, ``fail_reason`` and ``retry_of`` (the stale trial a
    retry re-measures).

    Raises:
        StudyNotFoundError: no such study.
    """
    study, storage = _load(url, name)
    rows = [
        {
            "stage": TrialStage.MEASURED, "number": t.number, "state": t.state.name,
            "predicted_ms": t.user_attrs.get("predicted_ms"), "measured_ms": t.value,
            "is_default": bool(t.user_attrs.get("is_default")), "params": t.params,
            "job": t.user_attrs.get("job"), "fail_reason": t.user_attrs.get("fail_reason"),
            "retry_of": t.system_attrs.get("failed_trial"),
        }
        for t in study.trials
    ]
    try:
        sim = optuna.load_study(study_name=name + SIM_SUFFIX, storage=storage)
    except KeyError:
        sim = None
    for t in sim.trials if sim else []:
        rows.append({
            "stage": TrialStage.SIMULATED, "number": t.number, "state": t.state.name,
            "predicted_ms": t.value, "measured_ms": None, "is_default": None, "params": t.params,
        })
    return rows


def best_plan(url: str, name: str) -> tuple[Plan, float | None]:
    """The best measured plan of study ``name`` (lowest step ms, ties to the lower trial) and the default's ms.

    Raises:
        StudyNotFoundError: no such study, or no measured plan in it yet.
    """
    study, storage = _load(url, name)
    done = complete_trials(study)
    if not done:
        raise StudyNotFoundError(f"study {name!r} has no measured trial yet; run `prefetch-planner tune` on it")
    best = min(done, key=lambda t: (t.value, t.number))
    defaults = [t.value for t in done if t.user_attrs.get("is_default")]
    with session(storage.engine) as s:
        row = s.scalars(
            sa.select(PlanRow).where(PlanRow.study_name == name, PlanRow.trial_number == best.number)
            .order_by(PlanRow.id.desc())
        ).first()
    if row is None:
        raise StudyNotFoundError(f"study {name!r} trial {best.number} has no stored plan")
    return Plan.from_json(row.json), (defaults[-1] if defaults else None)
