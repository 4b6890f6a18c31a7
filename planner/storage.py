"""The planner's own tables, beside Optuna's in the same database.

Optuna's RDB storage holds the studies and trials; these tables hold what
Optuna does not: the recorded profiles, every measured plan's JSON, and the
measured runs (per-step and per-rank figures), so plain SQL answers questions::

    sqlite3 studies/llama-cpu.db 'select trial_number, predicted_ms, measured_ms from planner_plans'
"""

from __future__ import annotations

import datetime as dt
import os
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from planner.errors import StorageError, StudyNotFoundError


T = TypeVar("T")


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


def sqlite_timeout_s() -> float:
    """How long a SQLite writer waits for another's lock, in s (``PREFETCH_PLANNER_SQLITE_TIMEOUT_S``, default 60)."""
    return float(os.environ.get("PREFETCH_PLANNER_SQLITE_TIMEOUT_S", "60"))


def engine_kwargs(url: str) -> dict[str, Any]:
    """``create_engine`` keyword arguments for ``url``, shared by Optuna's storage and ours.

    SQLite: a busy timeout (:func:`sqlite_timeout_s`), so concurrent jobs
    queue for the write lock instead of failing at once. PostgreSQL: a 10 s
    connect timeout, so an unreachable server is an error, not a hang.
    """
    backend = sa.engine.make_url(url).get_backend_name()
    if backend == "sqlite":
        return {"connect_args": {"timeout": sqlite_timeout_s()}}
    if backend == "postgresql":
        return {"connect_args": {"connect_timeout": 10}, "pool_pre_ping": True}
    return {}


def describe_storage_error(url: str, e: BaseException) -> str:
    """One line naming what is wrong with the storage at ``url`` and how to fix it."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if isinstance(e, ImportError):
        return (f"cannot open storage {url!r}: its database driver is not installed ({text}); "
                "for PostgreSQL: pip install 'prefetch-planner[postgres]'")
    if "database is locked" in text:
        return (f"storage {url!r} is locked: another process held its write lock for more than "
                f"{sqlite_timeout_s():.0f} s; end that process (or raise PREFETCH_PLANNER_SQLITE_TIMEOUT_S) "
                "and run again")
    return f"cannot open storage {url!r}: {text}"


def create_racing(create: Callable[[], T], attempts: int = 5) -> T:
    """Run ``create`` (tables made with check-then-create), retrying when a concurrent job made them first.

    Two jobs starting on a new database both see a table missing and both
    create it; the second gets "already exists" (SQLite) or a duplicate key
    on the catalog (PostgreSQL), and Optuna's version row a unique-constraint
    error. The tables are then there: trying again succeeds.
    """
    for attempt in range(attempts):
        try:
            return create()
        except sa.exc.SQLAlchemyError as e:
            text = str(e).lower()
            racing = ("already exists", "duplicate key", "unique constraint")  # SQLite, PostgreSQL, both
            if attempt == attempts - 1 or not any(r in text for r in racing):
                raise
            time.sleep(0.1 * (attempt + 1))
    raise AssertionError("unreachable")


def engine_for(url: str) -> sa.Engine:
    """An engine with the planner's tables created.

    Raises:
        StorageError: the URL is malformed or the database cannot be opened.
    """
    try:
        engine = sa.create_engine(url, **engine_kwargs(url))
        create_racing(lambda: Base.metadata.create_all(engine))
    except (sa.exc.SQLAlchemyError, ImportError, ValueError) as e:
        raise StorageError(describe_storage_error(url, e)) from None
    return engine


def check_writable(url: str) -> None:
    """Check, without changing anything, that a job could write to ``url`` now.

    SQLite: takes the write lock (``BEGIN IMMEDIATE``) and releases it,
    waiting at most :func:`sqlite_timeout_s`; a file that does not exist yet
    is not created (its folder must exist). Other databases: connects.

    Raises:
        StorageError: unreachable server, missing driver, malformed URL, or a
            SQLite file whose write lock another process holds.
    """
    try:
        u = sa.engine.make_url(url)
        if u.get_backend_name() == "sqlite" and u.database not in (None, "", ":memory:"):
            if not Path(u.database).exists():
                if not Path(u.database).parent.is_dir():
                    raise StorageError(f"cannot create storage {url!r}: folder "
                                       f"{str(Path(u.database).parent)!r} does not exist")
                return
        engine = sa.create_engine(url, **engine_kwargs(url))
        with engine.connect() as conn:
            if engine.dialect.name == "sqlite":
                conn.exec_driver_sql("BEGIN IMMEDIATE")
                conn.exec_driver_sql("ROLLBACK")
            else:
                conn.exec_driver_sql("SELECT 1")
        engine.dispose()
    except (sa.exc.SQLAlchemyError, ImportError, ValueError) as e:
        raise StorageError(describe_storage_error(url, e)) from None


def session(engine: sa.Engine) -> Session:
    """A session on ``engine`` (use as a context manager)."""
    return Session(engine, expire_on_commit=False)
