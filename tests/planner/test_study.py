"""The study driver without ranks: simulated stage, candidate choice, tell, queries."""

from __future__ import annotations

import sqlite3

import pytest

from planner.config import StudyConfig
from planner.errors import StudyNotFoundError
from planner.study import (
    MeasuredStage, best_plan, list_studies, open_storage, select_candidates, simulated_stage, study_trials,
)


@pytest.fixture
def config(tmp_path):
    return StudyConfig(
        name="t", storage=f"sqlite:///{tmp_path}/t.db", factory="runtime.workloads:mlp",
        space="uniform", sim_trials=40, measured_trials=3, directory=str(tmp_path),
    )


def _run(make_profile, config, measured_ms):
    profile = make_profile(n_blocks=4, fwd=10.0, bwd=20.0, ag=8.0, rs=3.0)
    storage = open_storage(config.storage)
    sim = simulated_stage(profile, config, storage, show_progress_bar=False)
    candidates = select_candidates(sim, profile, config.space, config.measured_trials)
    stage = MeasuredStage(config, storage, profile)
    asked = stage.ask(candidates)
    times = [[ms, ms + 1.0, ms - 1.0] for ms in measured_ms[: len(asked)]]
    per_rank = [[t, t] for t in times]
    return profile, sim, candidates, stage.tell(asked, times, per_rank)


def test_simulated_stage_enqueues_grid_and_ranks_candidates(make_profile, config):
    profile, sim, candidates, _ = _run(make_profile, config, [100.0, 90.0, 80.0, 95.0])
    assert len(sim.trials) == 40
    # FSDP2's default and the 24-point uniform grid come first
    assert sim.trials[0].params == {"forward_depth": 0, "backward_depth": 1, "unshard_async_op": False}
    assert len({tuple(sorted(t.params.items())) for t in sim.trials[:24]}) == 24
    assert candidates[0].plan.is_default_for(profile)
    assert len(candidates) == 4
    assert len({c.plan.behaviour_key() for c in candidates}) == 4
    rest = [c.predicted_ms for c in candidates[1:]]
    assert rest == sorted(rest) and rest[0] == min(t.value for t in sim.trials if t.value is not None)


def test_tell_best_and_queries(make_profile, config):
    _, _, candidates, plans = _run(make_profile, config, [100.0, 90.0, 80.0, 95.0])
    assert [p.provenance.measured_ms for p in plans] == [100.0, 90.0, 80.0, 95.0]
    assert all(p.provenance.default_measured_ms == 100.0 for p in plans)
    best, default_ms = best_plan(config.storage, "t")
    assert best.provenance.measured_ms == 80.0 and default_ms == 100.0
    assert best.behaviour_key() == candidates[2].plan.behaviour_key()
    [summary] = list_studies(config.storage)
    assert (summary.name, summary.measured_trials, summary.simulated_trials) == ("t", 4, 40)
    assert (summary.best_ms, summary.default_ms) == (80.0, 100.0)
    rows = study_trials(config.storage, "t")
    assert sum(r["stage"] == "measured" for r in rows) == 4 and sum(r["stage"] == "simulated" for r in rows) == 40
    # plain SQL answers without Python objects
    db = config.storage.removeprefix("sqlite:///")
    got = sqlite3.connect(db).execute(
        "select measured_ms from planner_plans where is_default = 1").fetchall()
    assert got == [(100.0,)]


def test_rerun_adds_trials_to_the_same_study(make_profile, config):
    _run(make_profile, config, [100.0, 90.0, 80.0, 95.0])
    _run(make_profile, config, [100.0, 70.0, 85.0, 99.0])
    [summary] = list_studies(config.storage)
    assert summary.measured_trials == 8 and summary.simulated_trials == 80
    assert best_plan(config.storage, "t")[0].provenance.measured_ms == 70.0


def test_failed_measurement_is_recorded(make_profile, config):
    profile = make_profile()
    storage = open_storage(config.storage)
    sim = simulated_stage(profile, config, storage, show_progress_bar=False)
    stage = MeasuredStage(config, storage, profile)
    asked = stage.ask(select_candidates(sim, profile, config.space, 1))
    stage.fail(asked, "RuntimeError: boom")
    trials = stage.study.trials
    assert [t.state.name for t in trials] == ["FAIL", "FAIL"]
    assert trials[0].user_attrs["fail_reason"] == "RuntimeError: boom"
    with pytest.raises(StudyNotFoundError, match="no measured trial"):
        best_plan(config.storage, "t")


def test_unknown_study_and_missing_db(make_profile, config, tmp_path):
    _run(make_profile, config, [100.0, 90.0, 80.0, 95.0])
    with pytest.raises(StudyNotFoundError, match="no study 'x'.*studies there: t"):
        best_plan(config.storage, "x")
    with pytest.raises(StudyNotFoundError, match="no database"):
        list_studies(f"sqlite:///{tmp_path}/none.db")
    assert not (tmp_path / "none.db").exists()
