"""SQLAlchemy engine helpers shared by Optuna's storage and the planner's tables.

One engine per storage URL: Optuna's (``RDBStorage.engine``), opened by
:func:`planner.storages.open_storage`; the planner's tables use it too. What
is here configures it (timeouts, SQLite pragmas), checks a URL before a job
starts, and turns database errors into one-line :class:`StorageError`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import optuna
import sqlalchemy as sa
from sqlalchemy.orm import Session

from planner.errors import StorageError, StudyNotFoundError

T = TypeVar("T")
logger = logging.getLogger(__name__)


def sqlite_timeout_s() -> float:
    """How long a SQLite writer waits for another's lock, in s (``PREFETCH_PLANNER_SQLITE_TIMEOUT_S``, default 60)."""
    return float(os.environ.get("PREFETCH_PLANNER_SQLITE_TIMEOUT_S", "60"))


def engine_kwargs(url: str) -> dict[str, Any]:
    """``create_engine`` keyword arguments for ``url``.

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


def use_sqlite_pragmas(engine: sa.Engine) -> None:
    """Switch a SQLite engine's connections to write-ahead logging with ``synchronous=NORMAL``.

    A commit then appends to the log instead of syncing the database file (SQLite's WAL mode), and readers do not
    block the writer. Reconnects the pool so every connection has them. No effect on other databases.
    """
    if engine.dialect.name != "sqlite":
        return
    sa.event.listen(engine, "connect", _sqlite_pragmas)
    engine.dispose()


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def describe_storage_error(url: str, e: BaseException, waited_s: float | None = None) -> str:
    """One line naming what is wrong with the storage at ``url`` and how to fix it.

    A locked SQLite file is told apart by how long the failed statement waited
    (:func:`time_lock_waits`, else ``waited_s``: at most that long, s): the
    whole busy timeout (another process held the write lock that long), or much
    less (SQLite refuses without waiting, e.g. ``SQLITE_BUSY_SNAPSHOT``: a
    transaction that read, then writes after another connection committed), or
    unknown (neither given).
    """
    e = _unwrapped(e)
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if isinstance(e, ImportError):
        return (f"cannot open storage {url!r}: its database driver is not installed ({text}); "
                "for PostgreSQL: pip install 'prefetch-planner[postgres]'")
    if "database is locked" in text:
        timeout = sqlite_timeout_s()
        waited = getattr(e, WAITED_S, waited_s)
        if waited is not None and _refused_at_once(waited):
            return (f"storage {url!r} is locked: SQLite refused a write after {waited:.2f} s, without waiting out "
                    f"its {timeout:g} s busy timeout (it does so when another process wrote since this "
                    "transaction read); run again")
        held = f"for {waited:.3g} s" if waited is not None else f"for more than {timeout:g} s"
        return (f"storage {url!r} is locked: another process held its write lock {held}; end that process "
                "(or raise PREFETCH_PLANNER_SQLITE_TIMEOUT_S) and run again")
    return f"cannot open storage {url!r}: {text}"


def _unwrapped(e: BaseException) -> BaseException:
    """The driver's error inside Optuna's ``StorageInternalError`` (its RDB storage wraps it), else ``e``."""
    if isinstance(e, optuna.exceptions.StorageInternalError) and isinstance(e.__cause__, sa.exc.SQLAlchemyError):
        return e.__cause__
    return e


def _refused_at_once(waited_s: float) -> bool:
    """A "database is locked" after ``waited_s`` s came well inside the busy timeout: SQLite did not wait it out."""
    return waited_s < 0.9 * sqlite_timeout_s()


def time_lock_waits(engine: sa.Engine) -> None:
    """Time each statement on ``engine``; a failed one's exception gets the seconds it took as ``WAITED_S``.

    For :func:`describe_storage_error`: "database is locked" after the whole
    busy timeout and after a moment are different problems. On SQLite a
    statement that succeeds after more than :data:`SLOW_WRITE_S` (it waited
    for another job's write lock: the planner's statements take milliseconds)
    is logged as a warning. SQLAlchemy events ``before_cursor_execute``,
    ``after_cursor_execute`` and ``handle_error``.
    """
    sa.event.listen(engine, "before_cursor_execute", _statement_started)
    sa.event.listen(engine, "handle_error", _statement_failed)
    if engine.dialect.name == "sqlite":
        sa.event.listen(engine, "after_cursor_execute", _statement_done)


WAITED_S = "prefetch_planner_waited_s"
SLOW_WRITE_S = 5.0
_STARTED = "prefetch_planner_statement_started"


def _statement_started(conn: sa.Connection, *_args: Any) -> None:
    conn.info[_STARTED] = time.monotonic()


def _statement_done(conn: sa.Connection, *_args: Any) -> None:
    took = time.monotonic() - conn.info.get(_STARTED, time.monotonic())
    if took > SLOW_WRITE_S:
        logger.warning(f"a statement on the study's SQLite file took {took:.1f} s, most likely waiting for another "
                       f"job's write lock (a job gives up after PREFETCH_PLANNER_SQLITE_TIMEOUT_S, "
                       f"{sqlite_timeout_s():g} s)")


def _statement_failed(context: sa.engine.ExceptionContext) -> None:
    started = context.connection.info.get(_STARTED) if context.connection is not None else None
    if started is not None and context.sqlalchemy_exception is not None:
        setattr(context.sqlalchemy_exception, WAITED_S, time.monotonic() - started)


@contextlib.contextmanager
def storage_errors(url: str) -> Iterator[None]:
    """Database errors inside become one-line :class:`StorageError`: SQLAlchemy's, and Optuna's
    ``StorageInternalError`` (which its RDB storage raises from a SQLAlchemy error, e.g. a locked file)."""
    try:
        yield
    except (sa.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError) as e:
        raise StorageError(describe_storage_error(url, e)) from None


def create_racing(create: Callable[[], T], attempts: int = 5) -> T:
    """Run ``create`` (tables made with check-then-create), retrying when a concurrent job made them first.

    Two jobs starting on a new database both see a table missing and both
    create it; the second gets "already exists" (SQLite) or a duplicate key
    on the catalog (PostgreSQL), and Optuna's version row a unique-constraint
    error. The tables are then there: trying again succeeds. A SQLite file
    that refused a write well inside its busy timeout ("database is locked"
    at once, see :func:`describe_storage_error`) is tried again too; one
    locked for the whole timeout is not.
    """
    for attempt in range(attempts):
        started = time.monotonic()
        try:
            return create()
        except (sa.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError) as e:
            text = str(_unwrapped(e)).lower()
            racing = ("already exists", "duplicate key", "unique constraint")  # SQLite, PostgreSQL, both
            refused = "database is locked" in text and _refused_at_once(time.monotonic() - started)
            if attempt == attempts - 1 or not (refused or any(r in text for r in racing)):
                raise
            time.sleep(0.1 * (attempt + 1))
    raise AssertionError("unreachable")


def _sqlite_file(url: str) -> Path | None:
    """The file a SQLite URL names, else ``None`` (other databases, in-memory SQLite)."""
    u = sa.engine.make_url(url)
    if u.get_backend_name() == "sqlite" and u.database not in (None, "", ":memory:"):
        return Path(u.database)
    return None


def check_exists(url: str) -> None:
    """For query commands: a SQLite URL must name an existing file.

    Raises:
        StudyNotFoundError: the SQLite file does not exist (opening it would
            create an empty database).
    """
    path = _sqlite_file(url)
    if path is not None and not path.exists():
        raise StudyNotFoundError(f"no database at {str(path)!r}; run `prefetch-planner tune` first or pass --storage")


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
        path = _sqlite_file(url)
        if path is not None and not path.exists():
            if not path.parent.is_dir():
                raise StorageError(f"cannot create storage {url!r}: folder {str(path.parent)!r} does not exist")
            return
        engine = sa.create_engine(url, **engine_kwargs(url))
        time_lock_waits(engine)
        try:
            with engine.connect() as conn:
                if engine.dialect.name == "sqlite":
                    conn.exec_driver_sql("BEGIN IMMEDIATE")
                    conn.exec_driver_sql("ROLLBACK")
                else:
                    conn.exec_driver_sql("SELECT 1")
        finally:
            engine.dispose()
    except (sa.exc.SQLAlchemyError, ImportError, ValueError) as e:
        raise StorageError(describe_storage_error(url, e)) from None


def session(engine: sa.Engine) -> Session:
    """A session on ``engine`` that keeps loaded rows usable after commit (use as a context manager)."""
    return Session(engine, expire_on_commit=False)
