"""Study databases: Optuna's RDB storage and the planner's tables beside it.

- :mod:`planner.storages.rdb`: :func:`open_storage`, the one way a study
  database is opened (one SQLAlchemy engine per URL, Optuna's).
- :mod:`planner.storages.models`: the planner's tables (ORM models).
- :mod:`planner.storages.engine`: engine settings, pre-flight checks and
  one-line storage errors.
"""

from planner.storages.engine import (
    check_exists,
    check_writable,
    describe_storage_error,
    session,
    sqlite_timeout_s,
    storage_errors,
)
from planner.storages.models import MeasuredRunRow, PlanRow, ProfileRow
from planner.storages.rdb import open_storage, open_storage_read_only

__all__ = [
    "MeasuredRunRow", "PlanRow", "ProfileRow", "check_exists", "check_writable", "describe_storage_error",
    "open_storage", "open_storage_read_only", "session", "sqlite_timeout_s", "storage_errors",
]
