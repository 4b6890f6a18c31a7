"""The bulk write of finished trials: Optuna reads back exactly what ``Study.add_trials`` would have stored."""

from __future__ import annotations

import math

import optuna
import pytest

from planner.storages import open_storage
from planner.storages.bulk import add_trials_bulk
from planner.study.records import PEAK_OVER_BUDGET


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/s.db"
    return request.getfixturevalue("postgres")()


def _in_memory_trials() -> list[optuna.trial.FrozenTrial]:
    """Two-objective trials with every kind of field: int, float, log float, categorical (incl. None),
    constraints, user attributes, an infinite value, and a failed trial."""
    study = optuna.create_study(directions=["minimize", "minimize"], sampler=optuna.samplers.RandomSampler(seed=3))

    def objective(trial):
        x = trial.suggest_int("fwd:a.b", 0, 3)
        y = trial.suggest_float("lr", 1e-5, 1e-1, log=True)
        c = trial.suggest_categorical("choice", [False, True, None, "x"])
        trial.set_user_attr("peak_bytes", 123 + x)
        trial.set_user_attr("nested", {"k": [1, 2.5, "s"]})
        trial.set_constraint(PEAK_OVER_BUDGET, float(x - 1))
        if trial.number == 4:
            raise ValueError("a plan that cannot be simulated")
        return (math.inf if c == "x" else float(x) + y), float(x * 10)

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study.optimize(objective, n_trials=12, catch=(ValueError,))
    return study.trials


def _comparable(t: optuna.trial.FrozenTrial) -> tuple:
    return (t.state, t.values, t.params, t.distributions, t.user_attrs, t.system_attrs, t.datetime_start,
            t.datetime_complete)


def test_bulk_write_reads_back_as_optunas_own(url):
    trials = _in_memory_trials()
    storage = open_storage(url)
    optuna.create_study(study_name="bulk", storage=storage, directions=["minimize", "minimize"])
    reference = optuna.create_study(study_name="one-by-one", storage=storage, directions=["minimize", "minimize"])
    reference.add_trials(trials)
    add_trials_bulk(storage, "bulk", trials[:5])
    add_trials_bulk(storage, "bulk", trials[5:])  # a second write continues the numbering
    got = optuna.load_study(study_name="bulk", storage=url).trials
    want = optuna.load_study(study_name="one-by-one", storage=url).trials
    assert [t.number for t in got] == list(range(len(trials)))
    assert [_comparable(t) for t in got] == [_comparable(t) for t in want]
    assert got[4].state == optuna.trial.TrialState.FAIL and got[4].values is None
    assert any(t.values and math.isinf(t.values[0]) for t in got)
    assert all(t.system_attrs == {f"constraints:{PEAK_OVER_BUDGET}": t.params["fwd:a.b"] - 1.0} for t in got)
    # what Optuna builds on it: the Pareto front and constrained sampling
    study = optuna.load_study(study_name="bulk", storage=url)
    assert {t.number for t in study.best_trials} == {t.number for t in reference.best_trials}


def test_bulk_write_refuses_unfinished_trials_and_writes_nothing(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    storage = open_storage(url)
    optuna.create_study(study_name="s", storage=storage)
    running = optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING)
    with pytest.raises(ValueError, match="finished trials only"):
        add_trials_bulk(storage, "s", [running])
    assert optuna.load_study(study_name="s", storage=url).trials == []


def _write_batches(url: str, barrier, batches: int) -> None:
    """One job's simulated stages: ``batches`` bulk writes of 3 trials each, started with the other jobs at once."""
    trials = _in_memory_trials()[:3]
    storage = open_storage(url)
    barrier.wait()
    for _ in range(batches):
        add_trials_bulk(storage, "shared.sim", trials)
    storage.engine.dispose()


def test_concurrent_bulk_writes_number_every_trial_once(url):
    """Jobs writing one study at once (``tests/runtime/ranks/test_cluster.py``): no two trials share a number.

    Optuna's cached storage keys trials by number, so a shared number hides a trial from every reader.
    """
    import multiprocessing as mp

    optuna.create_study(study_name="shared.sim", storage=open_storage(url), directions=["minimize", "minimize"])
    jobs, batches = 4, 12
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(jobs)
        procs = [ctx.Process(target=_write_batches, args=(url, barrier, batches)) for _ in range(jobs)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0] * jobs
    storage = optuna.storages.RDBStorage(url, skip_compatibility_check=True)
    study_id = storage.get_study_id_from_name("shared.sim")
    with storage.engine.connect() as conn:
        numbers = [n for (n,) in conn.exec_driver_sql(
            f"select number from trials where study_id = {study_id} order by trial_id")]
    storage.engine.dispose()
    assert numbers == list(range(jobs * batches * 3))
