"""The planner's own tables, beside Optuna's in the same database.

Optuna's RDB storage holds the studies and trials; these tables hold what
Optuna does not: the recorded profiles, every measured plan's JSON, and the
measured runs (per-step and per-rank figures), so plain SQL answers questions::

    sqlite3 studies/llama-cpu.db 'select trial_number, predicted_ms, measured_ms from planner_plans'
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from planner.errors import StorageError, StudyNotFoundError


class Base(DeclarativeBase):
    pass


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class ProfileRow(Base):
    """A recorded profile (``planner_profiles``)."""

    __tablename__ = "planner_profiles"
    id: Mapped[int] = mapped_column(primary_key=True)
    study_name: Mapped[str] = mapped_column(sa.String(512), index=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=_now)
    measured_step_ms: Mapped[float | None]
    json: Mapped[str] = mapped_column(sa.Text)


class PlanRow(Base):
    """A plan measured on the real ranks (``planner_plans``); times in ms."""

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
    """One interleaved measurement of one plan (``planner_measured_runs``)."""

    __tablename__ = "planner_measured_runs"
    id: Mapped[int] = mapped_column(primary_key=True)
    plan_id: Mapped[int] = mapped_column(sa.ForeignKey("planner_plans.id"), index=True)
    study_name: Mapped[str] = mapped_column(sa.String(512), index=True)
    step_ms_json: Mapped[str] = mapped_column(sa.Text)  # max across ranks, per step
    per_rank_json: Mapped[str] = mapped_column(sa.Text)  # [rank][step]
    created_at: Mapped[dt.datetime] = mapped_column(default=_now)


def check_exists(url: str) -> None:
    """For query commands: a SQLite URL must name an existing file.

    Raises:
        StudyNotFoundError: the SQLite file does not exist (opening it would
            create an empty database).
    """
    u = sa.engine.make_url(url)
    if u.get_backend_name() == "sqlite" and u.database not in (None, "", ":memory:"):
        if not Path(u.database).exists():
            raise StudyNotFoundError(f"no database at {u.database!r}; run `prefetch-planner tune` first or pass --storage")


def engine_for(url: str) -> sa.Engine:
    """An engine with the planner's tables created.

    Raises:
        StorageError: the URL is malformed or the database cannot be opened.
    """
    try:
        engine = sa.create_engine(url)
        Base.metadata.create_all(engine)
    except (sa.exc.SQLAlchemyError, ImportError, ValueError) as e:
        raise StorageError(f"cannot open storage {url!r}: {str(e).splitlines()[0]}") from None
    return engine


def session(engine: sa.Engine) -> Session:
    """A session on ``engine`` (use as a context manager)."""
    return Session(engine, expire_on_commit=False)
