"""The planner's own tables, beside Optuna's in the same database (SQLAlchemy ORM models).

Optuna's RDB storage holds the studies and trials; these tables hold what
Optuna does not: the recorded profiles, every measured plan's JSON, and the
measured runs (per-step and per-rank figures), so plain SQL answers questions::

    sqlite3 studies/llama-cpu.db 'select trial_number, predicted_ms, measured_ms from planner_plans'

The tables are created when the storage is opened
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
    """A plan measured on the real ranks (``planner_plans``); times in ms, sizes in bytes."""

    __tablename__ = "planner_plans"
    id: Mapped[int] = mapped_column(primary_key=True)
    study_name: Mapped[str] = mapped_column(sa.String(512), index=True)
    trial_number: Mapped[int]
    profile_id: Mapped[int | None] = mapped_column(sa.ForeignKey("planner_profiles.id"))
    is_default: Mapped[bool]
    predicted_ms: Mapped[float | None]
    measured_ms: Mapped[float | None]
    predicted_peak_bytes: Mapped[int | None] = mapped_column(sa.BigInteger)
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
