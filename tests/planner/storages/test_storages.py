"""The study database layer, one suite over every backend (SQLite and PostgreSQL), as Optuna tests its storages."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time

import optuna
import pytest
import sqlalchemy as sa

from planner.errors import StorageError, StudyNotFoundError
from planner.storages import (
    PlanRow,
    ProfileRow,
    check_exists,
    check_writable,
    describe_storage_error,
    open_storage,
    open_storage_read_only,
    session,
    storage_errors,
)
from planner.storages import engine as engine_module
from planner.storages.engine import create_racing
from planner.storages.models import Base


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/s.db"
    return request.getfixturevalue("postgres")()


def test_open_storage_creates_the_planner_tables_on_optunas_engine(url):
    storage = open_storage(url)
    try:
        tables = set(sa.inspect(storage.engine).get_table_names())
        assert {"planner_profiles", "planner_plans", "planner_measured_runs"} <= tables
        assert "trials" in tables  # Optuna's, same database
        with session(storage.engine) as s:  # the one engine of this URL serves our rows too
            s.add(ProfileRow(study_name="s", measured_step_ms=1.0, json="{}"))
            s.commit()
        again = open_storage(url)  # tables exist: opening again changes nothing
        with session(again.engine) as s:
            assert s.scalar(sa.select(sa.func.count()).select_from(ProfileRow)) == 1
        again.engine.dispose()
    finally:
        storage.engine.dispose()


def test_sqlite_uses_write_ahead_logging(tmp_path):
    storage = open_storage(f"sqlite:///{tmp_path}/s.db")
    with storage.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL
    storage.engine.dispose()


def test_optuna_reads_the_database(url):
    storage = open_storage(url)
    optuna.create_study(study_name="s", storage=storage).add_trial(optuna.trial.create_trial(value=1.0))
    storage.engine.dispose()
    plain = optuna.storages.RDBStorage(url)  # Optuna alone, no planner code: what optuna-dashboard opens
    assert [t.value for t in optuna.load_study(study_name="s", storage=plain).trials] == [1.0]
    plain.engine.dispose()


def test_check_exists_refuses_a_missing_sqlite_file_without_creating_it(tmp_path):
    missing = tmp_path / "none.db"
    with pytest.raises(StudyNotFoundError, match="no database at"):
        check_exists(f"sqlite:///{missing}")
    assert not missing.exists()
    check_exists("sqlite://")  # in memory: nothing to find
    check_exists("postgresql+psycopg2://x@127.0.0.1:9/y")  # servers are checked when opened


def test_check_writable_writes_nothing(tmp_path):
    new = tmp_path / "new.db"
    check_writable(f"sqlite:///{new}")
    assert not new.exists()
    with pytest.raises(StorageError, match="folder .* does not exist"):
        check_writable(f"sqlite:///{tmp_path}/no/dir/x.db")


def test_check_writable_names_a_held_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFETCH_PLANNER_SQLITE_TIMEOUT_S", "0.2")
    db = tmp_path / "s.db"
    open_storage(f"sqlite:///{db}").engine.dispose()
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StorageError, match=r"held its write lock for (0\.[2-9]|1\.)\d* s"):
            check_writable(f"sqlite:///{db}")
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_a_write_that_waited_out_the_busy_timeout_says_how_long(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFETCH_PLANNER_SQLITE_TIMEOUT_S", "0.3")
    url = f"sqlite:///{tmp_path / 's.db'}"
    engine = open_storage(url).engine
    holder = sqlite3.connect(tmp_path / "s.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StorageError) as info, storage_errors(url), engine.begin() as conn:
            conn.exec_driver_sql("INSERT INTO planner_profiles (study_name, measured_step_ms, json, created_at) "
                                 "VALUES ('s', 1, '', '2026-11-28')")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
        engine.dispose()
    waited = float(str(info.value).split("write lock for ")[1].split(" s")[0])
    assert 0.3 <= waited < 2.0, info.value


def test_a_write_that_waited_long_for_the_lock_is_logged(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(engine_module, "SLOW_WRITE_S", 0.2)
    url = f"sqlite:///{tmp_path / 's.db'}"
    engine = open_storage(url).engine
    holder = sqlite3.connect(tmp_path / "s.db", isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    release = threading.Timer(0.5, holder.execute, ["ROLLBACK"])
    release.start()
    try:
        with caplog.at_level(logging.WARNING, logger="planner.storages.engine"), engine.begin() as conn:
            conn.exec_driver_sql("INSERT INTO planner_profiles (study_name, measured_step_ms, json, created_at) "
                                 "VALUES ('s', 1, '', '2026-11-28')")
            conn.exec_driver_sql("SELECT count(*) FROM planner_profiles").all()  # quick: not logged
    finally:
        release.join()
        holder.close()
        engine.dispose()
    slow = [m for m in caplog.messages if "most likely waiting for another job's write lock" in m]
    assert len(slow) == 1, slow
    assert 0.4 <= float(slow[0].split(" took ")[1].split(" s")[0]) < 3.0, slow


def test_a_storage_locked_while_optuna_builds_it_says_how_long_it_waited(tmp_path, monkeypatch):
    """Optuna's statements in ``RDBStorage()`` are not timed one by one: the message bounds the wait by the call's."""
    monkeypatch.setenv("PREFETCH_PLANNER_SQLITE_TIMEOUT_S", "0.3")
    holder = sqlite3.connect(tmp_path / "s.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StorageError) as info:
            open_storage(f"sqlite:///{tmp_path / 's.db'}")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert "held its write lock for " in str(info.value) and "more than" not in str(info.value), info.value
    assert 0.3 <= float(str(info.value).split("write lock for ")[1].split(" s")[0]) < 5.0, info.value


def test_optunas_write_on_a_locked_file_is_one_line_too(tmp_path, monkeypatch):
    """Optuna wraps the lock in its StorageInternalError; the message still says how long the write waited."""
    monkeypatch.setenv("PREFETCH_PLANNER_SQLITE_TIMEOUT_S", "0.3")
    url = f"sqlite:///{tmp_path / 's.db'}"
    storage = open_storage(url)
    holder = sqlite3.connect(tmp_path / "s.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StorageError, match=r"held its write lock for (0\.[3-9]|1\.)\d* s"), \
                storage_errors(url):
            optuna.create_study(study_name="s", storage=storage)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
        storage.engine.dispose()


def test_a_write_refused_at_once_is_not_blamed_on_a_long_held_lock(tmp_path, monkeypatch):
    """SQLITE_BUSY_SNAPSHOT: a transaction that read, then writes after another connection committed, is refused
    without the busy timeout (https://sqlite.org/rescode.html#busy_snapshot); the message says so."""
    monkeypatch.setenv("PREFETCH_PLANNER_SQLITE_TIMEOUT_S", "30")
    url = f"sqlite:///{tmp_path / 's.db'}"
    engine = open_storage(url).engine
    other = sqlite3.connect(tmp_path / "s.db", isolation_level=None)
    insert = ("INSERT INTO planner_profiles (study_name, measured_step_ms, json, created_at) "
              "VALUES ('s', 1, '', '2026-11-28')")
    started = time.monotonic()
    try:
        with pytest.raises(StorageError) as info, storage_errors(url), engine.connect() as conn:
            conn.exec_driver_sql("BEGIN")
            conn.exec_driver_sql("SELECT count(*) FROM planner_profiles").all()  # this transaction's snapshot
            other.execute(insert)  # another process commits after it
            conn.exec_driver_sql(insert)
    finally:
        other.close()
        engine.dispose()
    assert time.monotonic() - started < 10
    assert float(str(info.value).split("SQLite refused a write after ")[1].split(" s")[0]) < 5.0, info.value
    assert "without waiting out its 30 s busy timeout" in str(info.value)
    assert "held its write lock" not in str(info.value)


def test_storage_errors_become_one_line():
    with pytest.raises(StorageError) as info, storage_errors("sqlite:///x.db"):
        raise sa.exc.OperationalError("SELECT 1", {}, Exception("disk I/O error\nsecond line"))
    assert "\n" not in str(info.value) and "cannot open storage 'sqlite:///x.db'" in str(info.value)
    missing_driver = describe_storage_error("postgresql://h/db", ImportError("No module named 'psycopg2'"))
    assert "pip install 'prefetch-planner[postgres]'" in missing_driver


def test_create_racing_retries_only_a_concurrent_creation():
    calls = []

    def racing():
        calls.append(1)
        if len(calls) < 3:
            raise sa.exc.OperationalError("CREATE TABLE", {}, Exception("table planner_plans already exists"))
        return "created"

    assert create_racing(racing) == "created" and len(calls) == 3

    def broken():
        calls.append(1)
        raise sa.exc.OperationalError("CREATE TABLE", {}, Exception("disk full"))

    calls.clear()
    with pytest.raises(sa.exc.OperationalError, match="disk full"):
        create_racing(broken)
    assert len(calls) == 1  # not a race: no retry


def test_create_racing_retries_a_lock_refused_at_once_not_one_held_for_the_timeout(monkeypatch):
    monkeypatch.setenv("PREFETCH_PLANNER_SQLITE_TIMEOUT_S", "0.2")
    calls = []

    def locked(wait_s: float):
        def create():
            calls.append(1)
            time.sleep(wait_s)
            if len(calls) < 2:
                try:  # as Optuna's RDB storage raises it
                    raise sa.exc.OperationalError("INSERT", {}, Exception("database is locked"))
                except sa.exc.OperationalError as e:
                    raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.") from e
            return "created"
        return create

    assert create_racing(locked(0.0)) == "created" and len(calls) == 2
    calls.clear()
    with pytest.raises(optuna.exceptions.StorageInternalError):
        create_racing(locked(0.2))  # waited out the whole busy timeout: not tried again
    assert len(calls) == 1


def test_models_are_the_planner_tables():
    assert set(Base.metadata.tables) == {"planner_profiles", "planner_plans", "planner_measured_runs",
                                         "planner_confirmations", "planner_calibration_launches", "planner_watches"}
    # each figure stored once: a measured plan's figures are its trial's (the planner_trials view reads them)
    assert not {"predicted_ms", "measured_ms", "predicted_peak_bytes"} & set(PlanRow.__table__.c.keys())


def test_the_trials_view_reads_each_figure_from_its_trial(url):
    storage = open_storage(url)
    study = optuna.create_study(study_name="s", storage=storage)
    attrs = {"predicted_ms": 90.5, "race_median_ms": 101.25, "predicted_peak_bytes": 3 * 2**33,
             "is_default": True, "baseline": False, "job": "job-1"}
    study.add_trial(optuna.trial.create_trial(value=95.0, user_attrs=attrs))
    study.add_trial(optuna.trial.create_trial(value=120.0, user_attrs={"is_default": False}))  # an older trial
    open_storage(url)  # a second open finds the view there
    with storage.engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT trial_number, state, objective_ms, predicted_ms, race_median_ms, predicted_peak_bytes, "
            "measured_peak_bytes, is_default, baseline, job FROM planner_trials WHERE study_name = 's' "
            "ORDER BY trial_number").all()
    assert [tuple(r) for r in rows] == [(0, "COMPLETE", 95.0, 90.5, 101.25, 3 * 2**33, None, True, False, "job-1"),
                                        (1, "COMPLETE", 120.0, None, 120.0, None, None, False, None, None)]


def test_read_only_storage_reads_and_cannot_write(url):
    storage = open_storage(url)
    optuna.create_study(study_name="s", storage=storage).add_trial(optuna.trial.create_trial(value=2.0))
    storage.engine.dispose()
    read_only = open_storage_read_only(url)
    try:
        assert [t.value for t in optuna.load_study(study_name="s", storage=read_only).trials] == [2.0]
        with pytest.raises(optuna.exceptions.StorageInternalError) as info:
            optuna.create_study(study_name="t", storage=read_only)
        assert "read" in str(info.value.__cause__).lower() and "only" in str(info.value.__cause__).lower()
    finally:
        read_only.engine.dispose()
    writable = open_storage(url)
    assert optuna.get_all_study_names(writable) == ["s"]  # the refused study was not created
    writable.engine.dispose()


def test_read_only_storage_needs_the_file(tmp_path):
    with pytest.raises(StudyNotFoundError, match="no database at"):
        open_storage_read_only(f"sqlite:///{tmp_path}/none.db")
    assert not (tmp_path / "none.db").exists()


def test_the_test_server_starts_on_another_port_when_its_port_is_taken():
    """A port taken between the draw and the server's bind (a concurrent test's connection) is drawn again."""
    import socket

    from tests.postgres import server_or_skip

    server = server_or_skip()
    taken = server.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        try:
            url = server.start()
            assert server.port != taken
            engine = sa.create_engine(url)
            with engine.connect() as conn:
                assert conn.exec_driver_sql("SELECT 1").scalar() == 1
            engine.dispose()
        finally:
            server.stop()
