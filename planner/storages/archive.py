"""The planner's tables (:mod:`planner.storages.models`), written and read: profiles, measured plans, their runs.

What Optuna's tables do not hold, beside them on the same engine, so plain
SQL answers questions about a study. Every write is one transaction.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa

from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.json_types import JsonObject
from planner.artifacts.plan import Plan
from planner.artifacts.profile import Profile
from planner.errors import PlannerError
from planner.storages.engine import session
from planner.storages.models import ConfirmationRow, MeasuredRunRow, PlanRow, ProfileRow, WatchRow

logger = logging.getLogger(__name__)


def save_profile(engine: sa.Engine, study_name: str, profile: Profile) -> int:
    """Store a recorded profile for study ``study_name``; its row id."""
    with session(engine) as s:
        row = ProfileRow(study_name=study_name, measured_step_ms=profile.measured_step_ms, json=profile.to_json())
        s.add(row)
        s.commit()
        return row.id


def stored_profiles(engine: sa.Engine, study_name: str) -> list[Profile]:
    """Every profile stored for study ``study_name``, oldest first (none: an empty list)."""
    with session(engine) as s:
        texts = s.scalars(sa.select(ProfileRow.json).where(ProfileRow.study_name == study_name)
                          .order_by(ProfileRow.id)).all()
    return [Profile.from_json(t) for t in texts]


def study_fingerprints(engine: sa.Engine, study_name: str) -> list[Fingerprint]:
    """The fingerprints of every profile stored for study ``study_name``, oldest first (none: an empty list)."""
    return [p.fingerprint for p in stored_profiles(engine, study_name)]


def update_profile(engine: sa.Engine, profile_id: int, profile: Profile) -> None:
    """Replace the JSON of profile row ``profile_id`` (e.g. with its calibration)."""
    with session(engine) as s:
        s.get(ProfileRow, profile_id).json = profile.to_json()
        s.commit()


def save_measured_plans(engine: sa.Engine, study_name: str, profile_id: int, plans: Sequence[Plan],
                        defaults: Sequence[bool], step_ms: Sequence[list[float]],
                        per_rank: Sequence[list[list[float]]],
                        confirmations: Sequence[tuple[list[JsonObject], JsonObject | None]]) -> None:
    """Store each measured plan, its measured run and the confirmation reached on it, in one transaction.

    Args:
        plans: the measured plans as stored (``planner.study.provenance.as_stored``: its trial named, the figures
            its trial stores and its verdict left out).
        defaults: per plan, whether it is FSDP2's default.
        step_ms: per plan, every step's max across ranks, ms.
        per_rank: per plan, per rank, that rank's step times, ms.
        confirmations: per plan, its confirmation launches' rounds (none: ``[]``) and its verdict (``None``: none)
            (``planner.study.records.MeasuredTrialRecord.confirmation_rows``), rows of ``planner_confirmations``.
    """
    with session(engine) as s:
        for plan, default, times, ranks, (launches, verdict) in zip(plans, defaults, step_ms, per_rank, confirmations,
                                                                    strict=True):
            pv = plan.provenance
            row = PlanRow(study_name=study_name, trial_number=pv.trial, profile_id=profile_id, is_default=default,
                          json=plan.to_json())
            s.add(row)
            s.flush()
            s.add(MeasuredRunRow(plan_id=row.id, study_name=study_name, step_ms_json=json.dumps(times),
                                 per_rank_json=json.dumps(ranks)))
            s.add_all(ConfirmationRow(study_name=study_name, trial_number=pv.trial, launch_json=json.dumps(launch))
                      for launch in launches)
            if verdict is not None:
                s.add(ConfirmationRow(study_name=study_name, trial_number=pv.trial,
                                      confirmation_json=json.dumps(verdict)))
        s.commit()


@dataclass(frozen=True)
class MeasuredSteps:
    """Every step a plan was measured for in one round (a row of ``planner_measured_runs``), ms.

    Attributes:
        trial: the measured study's trial.
        step_ms: every step's max across ranks, in the order run (race, then confirmation).
        per_rank_ms: per rank, that rank's own step times ``[rank][step]``.
    """

    trial: int
    step_ms: list[float]
    per_rank_ms: list[list[float]]


def measured_steps(engine: sa.Engine, study_name: str) -> list[MeasuredSteps]:
    """Every measured round's steps of study ``study_name``, oldest first; the one store of a round's step times
    (the trials hold their medians and ratios)."""
    with session(engine) as s:
        rows = s.execute(
            sa.select(PlanRow.trial_number, MeasuredRunRow.step_ms_json, MeasuredRunRow.per_rank_json)
            .join(PlanRow, MeasuredRunRow.plan_id == PlanRow.id)
            .where(MeasuredRunRow.study_name == study_name).order_by(MeasuredRunRow.id)
        ).all()
    return [MeasuredSteps(trial, json.loads(times), json.loads(ranks)) for trial, times, ranks in rows]


def latest_calibration(engine: sa.Engine, study_name: str, profile: Profile) -> dict[str, float] | None:
    """The newest calibration stored for study ``study_name`` on the same model and world as ``profile``, if any."""
    with session(engine) as s:
        rows = s.scalars(
            sa.select(ProfileRow).where(ProfileRow.study_name == study_name).order_by(ProfileRow.id.desc())
        ).all()
    for row in rows:
        try:
            stored = Profile.from_json(row.json)
        except PlannerError:  # a row an older or newer planner wrote
            continue
        if stored.calibration and stored.fingerprint.first_difference(profile.fingerprint) is None:
            return stored.calibration
    return None


def with_stored_calibration(engine: sa.Engine, study_name: str, profile: Profile) -> Profile:
    """``profile`` with the newest calibration stored for it (:func:`latest_calibration`), logged; as it is where
    there is none."""
    stored = latest_calibration(engine, study_name, profile)
    if not stored:
        return profile
    logger.info("      using the simulator's fit from an earlier run of this study: "
                + ", ".join(f"{k} {v:.3g}" for k, v in stored.items()))
    return dataclasses.replace(profile, calibration=stored)


def stored_plan(engine: sa.Engine, study_name: str, trial: int) -> Plan | None:
    """The newest plan stored for ``trial`` of study ``study_name``, ``None`` if there is none."""
    with session(engine) as s:
        row = s.scalars(
            sa.select(PlanRow).where(PlanRow.study_name == study_name, PlanRow.trial_number == trial)
            .order_by(PlanRow.id.desc())
        ).first()
    return None if row is None else Plan.from_json(row.json)


def save_confirmation_row(engine: sa.Engine, study_name: str, trial: int, launch: dict | None = None,
                          confirmation: dict | None = None) -> None:
    """Store a confirmation launch's rounds or a confirmation's verdict reached in fresh launches, after its trial
    finished (JSON values)."""
    with session(engine) as s:
        s.add(ConfirmationRow(study_name=study_name, trial_number=trial,
                              launch_json=None if launch is None else json.dumps(launch),
                              confirmation_json=None if confirmation is None else json.dumps(confirmation)))
        s.commit()


def confirmation_rows(engine: sa.Engine, study_name: str) -> dict[int, tuple[list[dict], dict | None]]:
    """Per trial of study ``study_name``: its launches' rounds, oldest first, and its latest verdict (JSON values)."""
    out: dict[int, tuple[list[dict], dict | None]] = {}
    with session(engine) as s:
        rows = s.scalars(sa.select(ConfirmationRow).where(ConfirmationRow.study_name == study_name)
                         .order_by(ConfirmationRow.id)).all()
    for row in rows:
        launches, verdict = out.get(row.trial_number, ([], None))
        if row.launch_json is not None:
            launches = [*launches, json.loads(row.launch_json)]
        if row.confirmation_json is not None:
            verdict = json.loads(row.confirmation_json)
        out[row.trial_number] = (launches, verdict)
    return out


def save_watch_row(engine: sa.Engine, study_name: str, trial: int, job: str, steps: int, checks: int,
                   ratio: float | None, statistic: float, reverted: bool) -> None:
    """Store where the watch of trial ``trial``'s plan stands (``planner_watches``)."""
    with session(engine) as s:
        s.add(WatchRow(study_name=study_name, trial_number=trial, job=job, steps=steps, checks=checks,
                       ratio=ratio, statistic=statistic, reverted=reverted))
        s.commit()


def watch_rows(engine: sa.Engine, study_name: str) -> dict[int, WatchRow]:
    """Per trial of study ``study_name``, the latest row of its watch (none: an empty dict)."""
    with session(engine) as s:
        rows = s.scalars(sa.select(WatchRow).where(WatchRow.study_name == study_name).order_by(WatchRow.id)).all()
        s.expunge_all()
    return {row.trial_number: row for row in rows}
