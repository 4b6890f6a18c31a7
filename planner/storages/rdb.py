"""Opening a study database: Optuna's RDB storage, with the planner's tables on the same engine."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
import sqlalchemy as sa

from planner.errors import StorageError
from planner.storages.engine import (
    check_exists,
    create_racing,
    describe_storage_error,
    engine_kwargs,
    time_lock_waits,
    use_sqlite_pragmas,
)
from planner.storages.models import Base, create_trials_view

if TYPE_CHECKING:
    from planner.artifacts.config import StudyConfig

# Optuna 5 renamed the stale-trial callback; 4.x has only the old name.
if hasattr(optuna.storages, "RetryHeartbeatStaleTrialCallback"):
    _RetryCallback = optuna.storages.RetryHeartbeatStaleTrialCallback
    _STALE_CALLBACK_ARG = "heartbeat_stale_trial_callback"
else:  # pragma: no cover - Optuna 4.x
    _RetryCallback = optuna.storages.RetryFailedTrialCallback
    _STALE_CALLBACK_ARG = "failed_trial_callback"


def open_storage(url: str, config: StudyConfig | None = None) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage at ``url``, its tables, the planner's and the ``planner_trials`` view created.

    The one SQLAlchemy engine of this URL is the storage's (``.engine``):
    the planner's tables (:mod:`planner.storages.models`) are created on it
    and read and written through it. SQLite files use write-ahead logging
    (:func:`planner.storages.engine.use_sqlite_pragmas`); a writer waits up to
    :func:`planner.storages.engine.sqlite_timeout_s` for another's lock. With
    ``config``, Optuna's heartbeat is on (``[study] heartbeat_interval_s``,
    ``grace_period_s``) and a stale trial's plan is re-queued up to
    ``[study] max_retry`` times (Optuna's stale-trial retry callback).

    Raises:
        StorageError: the URL cannot be opened (the message says why).
    """
    started = time.monotonic()  # Optuna's own statements while it builds the storage are not timed one by one
    try:
        with warnings.catch_warnings():  # the heartbeat and its callback are "experimental" since Optuna 2.8
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            heartbeat: dict[str, Any] = {}
            if config is not None:
                heartbeat = {
                    "heartbeat_interval": config.study.heartbeat_interval_s,
                    "grace_period": config.study.grace_period_s,
                    _STALE_CALLBACK_ARG: _RetryCallback(max_retry=config.study.max_retry),
                }
            storage = create_racing(
                lambda: optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs(url), **heartbeat)
            )
        use_sqlite_pragmas(storage.engine)
        time_lock_waits(storage.engine)
        create_racing(lambda: Base.metadata.create_all(storage.engine))
        create_racing(lambda: create_trials_view(storage.engine))
        return storage
    except Exception as e:  # noqa: BLE001 - SQLAlchemy/driver errors of every kind
        raise StorageError(describe_storage_error(url, e, waited_s=time.monotonic() - started)) from None


def open_storage_read_only(url: str) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage at ``url``, opened so that nothing can be written through it.

    For a training job that only reads its study. SQLite: the file is opened
    with ``mode=ro`` (it must exist); PostgreSQL: every transaction is
    ``READ ONLY``. No table is created and no schema is upgraded.

    Raises:
        StudyNotFoundError: a SQLite file that does not exist.
        StorageError: the URL cannot be opened.
    """
    check_exists(url)
    try:
        u = sa.engine.make_url(url)
        kwargs = engine_kwargs(url)
        if u.get_backend_name() == "sqlite" and u.database not in (None, "", ":memory:"):
            url = f"sqlite:///file:{Path(u.database).resolve()}?mode=ro&uri=true"
        elif u.get_backend_name() == "postgresql":
            kwargs["connect_args"] = {**kwargs.get("connect_args", {}),
                                      "options": "-c default_transaction_read_only=on"}
        return optuna.storages.RDBStorage(url, engine_kwargs=kwargs, skip_compatibility_check=True,
                                          skip_table_creation=True)
    except Exception as e:  # noqa: BLE001 - SQLAlchemy/driver errors of every kind
        raise StorageError(describe_storage_error(url, e)) from None
