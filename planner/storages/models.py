"""The planner's own tables, beside Optuna's in the same database (SQLAlchemy ORM models).

Optuna's RDB storage holds the studies and trials; these tables hold what
Optuna does not: the recorded profiles, every measured plan's JSON, and the
measured runs (per-step and per-rank figures), so plain SQL answers questions::

    sqlite3 studies/llama-cpu.db 'select trial_number, predicted_ms, race_median_ms from planner_trials'

Each figure is stored once: a measured trial's prediction and the figures made
from its steps on the trial (Optuna's user attributes), its steps in
``planner_measured_runs``, its verdict in ``planner_confirmations``, and the
plan as measured, without them, in ``planner_plans``. ``planner_trials`` is a
view of the first, not a copy.

The tables and the view are created when the storage is opened
(:func:`planner.storages.open_storage`), on Optuna's own engine.
"""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    """Declarative base of the planner's tables (``Base.metadata``)."""


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class ProfileRow(Base):
    """A recorded profile (``planner_profiles``); ``json`` is the Profile JSON, calibration included."""

    __tablename__ = "planner_profiles"
    id: Mapped[int] = mapped_column(primary_key=True)
    study_name: Mapped[str] = mapped_column(sa.String(512), index=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=_now)
    measured_step_ms: Mapped[float | None]
    json: Mapped[str] = mapped_column(sa.Text)


class PlanRow(Base):
    """A plan measured on the real ranks (``planner_plans``): ``json`` is the Plan JSON as measured, without the
    figures its trial stores (``planner.study.provenance.as_stored``). Databases written by release 0.2.0 and
    earlier also have ``predicted_ms``, ``measured_ms`` and ``predicted_peak_bytes`` columns, left as they were."""

    __tablename__ = "planner_plans"
    id: Mapped[int] = mapped_column(primary_key=True)
    study_name: Mapped[str] = mapped_column(sa.String(512), index=True)
    trial_number: Mapped[int]
    profile_id: Mapped[int | None] = mapped_column(sa.ForeignKey("planner_profiles.id"))
    is_default: Mapped[bool]
    created_at: Mapped[dt.datetime] = mapped_column(default=_now)
    json: Mapped[str] = mapped_column(sa.Text)


class MeasuredRunRow(Base):
    """One interleaved measurement of one plan (``planner_measured_runs``); times in ms."""

    __tablename__ = "planner_measured_runs"
    id: Mapped[int] = mapped_column(primary_key=True)
    plan_id: Mapped[int] = mapped_column(sa.ForeignKey("planner_plans.id"), index=True)
    study_name: Mapped[str] = mapped_column(sa.String(512), index=True)
    step_ms_json: Mapped[str] = mapped_column(sa.Text)  # max across ranks, per step
    per_rank_json: Mapped[str] = mapped_column(sa.Text)  # [rank][step]
    created_at: Mapped[dt.datetime] = mapped_column(default=_now)


class ConfirmationRow(Base):
    """A confirmation launch or a verdict (``planner_confirmations``): the one store of both.

    Optuna freezes a trial once it is COMPLETE, and a race survivor is often confirmed after its job ends, in fresh
    launches; so every confirmation lives here, reached in the job's own process or later. Each launch is a row
    with its rounds (``launch_json``: ``{"plan_ms": [...], "default_ms": [...]}``, ms), and the conclusion a row with
    the verdict (``confirmation_json``: ``planner.study.records.confirmation_attrs``).
    """

    __tablename__ = "planner_confirmations"
    id: Mapped[int] = mapped_column(primary_key=True)
    study_name: Mapped[str] = mapped_column(sa.String(512), index=True)
    trial_number: Mapped[int]
    launch_json: Mapped[str | None] = mapped_column(sa.Text)
    confirmation_json: Mapped[str | None] = mapped_column(sa.Text)
    created_at: Mapped[dt.datetime] = mapped_column(default=_now)


class CalibrationLaunchRow(Base):
    """One fresh launch of a cluster's calibration (``planner_calibration_launches``): an unselected plan against
    FSDP2's default (``planner.study.cluster_spread``).

    The cluster is ``(device_type, backend, world_size, mesh)``, ``mesh`` ``""`` for FSDP over every rank, else
    ``"2x4"`` (replicate x shard); ``pair`` names what ran against the default (``"default"``: a second copy of it,
    else the plan's key); ``launch_json`` holds the rounds (``{"plan_ms": [...], "default_ms": [...]}``, ms).
    """

    __tablename__ = "planner_calibration_launches"
    id: Mapped[int] = mapped_column(primary_key=True)
    device_type: Mapped[str] = mapped_column(sa.String(32), index=True)
    backend: Mapped[str] = mapped_column(sa.String(32))
    world_size: Mapped[int]
    mesh: Mapped[str] = mapped_column(sa.String(64))
    pair: Mapped[str] = mapped_column(sa.String(512))
    study_name: Mapped[str] = mapped_column(sa.String(512))
    launch_json: Mapped[str] = mapped_column(sa.Text)
    created_at: Mapped[dt.datetime] = mapped_column(default=_now)


class WatchRow(Base):
    """Where the watch of a plan applied in the process that measured it stood (``planner_watches``;
    ``planner.statistics.watch``): one row each time the in-loop tuner reports it, the last one its end.

    ``ratio`` is the plan's total-time ratio to FSDP2's default over the checks; ``reverted`` whether the watch
    found it slower in total and applied FSDP2's default.
    """

    __tablename__ = "planner_watches"
    id: Mapped[int] = mapped_column(primary_key=True)
    study_name: Mapped[str] = mapped_column(sa.String(512), index=True)
    trial_number: Mapped[int]
    job: Mapped[str] = mapped_column(sa.String(512))
    steps: Mapped[int]
    checks: Mapped[int]
    ratio: Mapped[float | None]
    statistic: Mapped[float]
    reverted: Mapped[bool]
    created_at: Mapped[dt.datetime] = mapped_column(default=_now)


TRIALS_VIEW = "planner_trials"
"""A view, one row per trial of every study: its figures as its Optuna user attributes store them."""

# (user attribute, its column's SQL, ``{v}`` the attribute's JSON text): a number is cast, which both SQLite (by
# type affinity: DOUBLE, INT) and PostgreSQL read as the number; a flag is compared with ``true`` (1/0 in SQLite, a
# boolean in PostgreSQL); a name loses its JSON quotes.
_NUMBER, _BYTES, _FLAG, _NAME = ("CAST({v} AS DOUBLE PRECISION)", "CAST({v} AS BIGINT)", "{v} = 'true'",
                                 "REPLACE({v}, '\"', '')")
_TRIALS_VIEW_ATTRS = (("predicted_ms", _NUMBER), ("race_median_ms", _NUMBER), ("race_ratio", _NUMBER),
                      ("predicted_peak_bytes", _BYTES), ("measured_peak_bytes", _BYTES), ("is_default", _FLAG),
                      ("baseline", _FLAG), ("job", _NAME))


def trials_view_sql() -> str:
    """``CREATE VIEW planner_trials``: per trial its study, number, state and objective 0 (``objective_ms``: a
    measured trial's value, the confirmed figure or its race median), and each user attribute of
    :data:`_TRIALS_VIEW_ATTRS` under its own name (``NULL`` where the trial has none). ``race_median_ms`` falls
    back to the value on trials written before the race median was stored apart, as
    ``MeasuredTrialRecord.race_ms`` does. Portable between SQLite and PostgreSQL; on Optuna's schema
    (``trials``, ``studies``, ``trial_values``, ``trial_user_attributes``)."""
    columns = []
    for key, sql in _TRIALS_VIEW_ATTRS:
        column = (f"(SELECT {sql.format(v='a.value_json')} FROM trial_user_attributes a "
                  f"WHERE a.trial_id = t.trial_id AND a.key = '{key}')")
        columns.append(f"{f'COALESCE({column}, v.value)' if key == 'race_median_ms' else column} AS {key}")
    return (f"CREATE VIEW {TRIALS_VIEW} AS SELECT s.study_name AS study_name, t.number AS trial_number, "
            "t.state AS state, v.value AS objective_ms, " + ", ".join(columns) +
            " FROM trials t JOIN studies s ON s.study_id = t.study_id "
            "LEFT JOIN trial_values v ON v.trial_id = t.trial_id AND v.objective = 0")


def create_trials_view(engine: sa.Engine) -> None:
    """Create :data:`TRIALS_VIEW` where the database lacks it (a concurrent job creating it first makes this raise
    "already exists": ``planner.storages.engine.create_racing`` tries again)."""
    if TRIALS_VIEW not in sa.inspect(engine).get_view_names():
        with engine.begin() as connection:
            connection.exec_driver_sql(trials_view_sql())
