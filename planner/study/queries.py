"""Questions asked of a study database: which studies, which trials, the best plan, the latest calibration.

Every function opens the storage once (:func:`planner.storages.open_storage`)
and reads Optuna's tables and the planner's through that one engine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, NamedTuple

import optuna
import sqlalchemy as sa

from planner.errors import PlannerError, StudyNotFoundError
from planner.artifacts.plan import Plan
from planner.artifacts.profile import Profile
from planner.artifacts.profile import Fingerprint
from planner.storages import check_exists, open_storage, open_storage_read_only
from planner.storages.archive import stored_plan
from planner.study.simulated import SIM_SUFFIX, complete_trials
from planner.statistics.verdict import Verdict, confirmation_text


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
    rows also ``job``, ``fail_reason``, ``retry_of`` (the stale trial a
    retry re-measures), ``race_ratio`` and ``dropped_after_round`` (the
    race), ``verdict``, ``measured_ratio`` and ``ratio_ci95`` (the
    confirmation, on the plan it confirmed).

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
            "retry_of": t.system_attrs.get("failed_trial"), "verdict": t.user_attrs.get("verdict"),
            "measured_ratio": t.user_attrs.get("measured_ratio"), "ratio_ci95": t.user_attrs.get("ratio_ci95"),
            "rounds": t.user_attrs.get("rounds"),
            "race_ratio": t.user_attrs.get("race_ratio"), "dropped_after_round": t.user_attrs.get("dropped_after_round"),
            "predicted_peak_bytes": t.user_attrs.get("predicted_peak_bytes"),
            "measured_peak_bytes": t.user_attrs.get("measured_peak_bytes"),
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
            "predicted_ms": t.values[0] if t.values else None, "measured_ms": None, "is_default": None,
            "params": t.params, "predicted_peak_bytes": t.user_attrs.get("peak_bytes"),
        })
    return rows


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


def confirmed_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """COMPLETE trials with a confirmation, confirmed faster first, then by ratio and trial number."""
    confirmed = [t for t in complete_trials(study) if t.user_attrs.get("verdict")]
    return sorted(confirmed, key=lambda t: (t.user_attrs["verdict"] != Verdict.FASTER,
                                            t.user_attrs["measured_ratio"], t.number))


def best_plan(url: str, name: str) -> BestPlan:
    """The plan study ``name`` recommends: the best confirmed faster than FSDP2's default, else the default.

    Raises:
        StudyNotFoundError: no such study, or no measured plan in it yet.
    """
    study, storage = _load(url, name)
    done = complete_trials(study)
    if not done:
        raise StudyNotFoundError(f"study {name!r} has no measured trial yet; run `prefetch-planner tune` on it")
    defaults = [t for t in done if t.user_attrs.get("is_default")]
    default_ms = defaults[-1].value if defaults else None
    confirmed = confirmed_trials(study)
    if confirmed and confirmed[0].user_attrs["verdict"] == Verdict.FASTER:
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
        faster = [t for t in confirmed_trials(study) if t.user_attrs["verdict"] == Verdict.FASTER]
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


def pareto_front(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows no other row beats on both ``predicted_ms`` and ``predicted_peak_bytes``, by peak ascending.

    One row per distinct point (the earliest trial); rows are those of
    :func:`study_trials` (simulated, with both figures).
    """
    out: list[dict[str, Any]] = []
    best_ms = float("inf")
    for r in sorted(rows, key=lambda r: (r["predicted_peak_bytes"], r["predicted_ms"], r["number"])):
        if r["predicted_ms"] < best_ms:
            out.append(r)
            best_ms = r["predicted_ms"]
    return out
