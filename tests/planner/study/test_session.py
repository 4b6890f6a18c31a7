"""The tuning session's decisions, driven by synthetic step times (no ranks): budget, calibration, verdicts, retries."""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import pytest

from planner.artifacts.plan import Plan
from planner.errors import MemoryBudgetError, PlannerError
from planner.simulation.simulator import SimParams
from planner.statistics.verdict import Verdict
from planner.study import study_trials
from planner.study.session import TuningSession
from planner.testing import drive_round, study_config
from search_spaces import get_space


def _session(tmp_path, profile, name="t", **fields) -> TuningSession:
    config = study_config(tmp_path, name=name, **{"space": "uniform", "sim_trials": 48, "measured_trials": 2,
                                                  "max_rounds": 6, "confirm_min_rounds": 8, "confirm_max_rounds": 8,
                                                  **fields})
    return TuningSession(
        config,
        profile,
        get_space(config.search.space),
        job="test",
        plan_out=str(tmp_path / f"{name}.plan.json"),
        profile_out=str(tmp_path / f"{name}.profile.json"),
    )


@pytest.fixture
def profile(make_profile):
    return make_profile(n_blocks=4, fwd=10.0, bwd=20.0, ag=8.0, rs=3.0)


def _noisy(effects: dict[bool, float], pct: float, seed: int = 0):
    """Step times: 100 ms for FSDP2's default, ``100 * effects[False]`` for the others, times lognormal noise."""
    rng = np.random.default_rng(seed)
    return lambda i, trial: 100.0 * (1.0 if i == 0 else effects[False]) * float(np.exp(rng.normal(0, pct / 100)))


# --- the memory budget -------------------------------------------------------------------------------------------

def test_a_budget_below_every_plan_is_refused_before_the_storage_is_touched(tmp_path, profile):
    session = _session(tmp_path, profile, memory_budget="1KiB")
    with pytest.raises(MemoryBudgetError, match="below the smallest predicted peak of any plan"):
        session.prepare()
    assert not (tmp_path / "t.db").exists()


def test_a_relative_budget_needs_the_measured_default_peak(tmp_path, profile):
    session = _session(tmp_path, dataclasses.replace(profile, measured_peak_bytes=None), memory_budget="+10%")
    with pytest.raises(MemoryBudgetError, match="relative to FSDP2's default's measured peak"):
        session.prepare()
    assert not (tmp_path / "t.db").exists()


# --- verdicts and what is written ---------------------------------------------------------------------------------

def test_a_candidate_confirmed_faster_is_written(tmp_path, profile):
    asked, outcome = drive_round(_session(tmp_path, profile), [100.0, 80.0, 90.0])
    assert asked[0].plan.is_default_for(profile)  # the baseline comes first
    pv = outcome.candidate.provenance
    assert (pv.verdict, pv.measured_ratio, tuple(pv.ratio_ci95)) == (Verdict.FASTER, 0.8, (0.8, 0.8))
    assert outcome.written is outcome.candidate and pv.trial == asked[1].number
    written = Plan.load(tmp_path / "t.plan.json")
    assert written.behaviour_key() == asked[1].plan.behaviour_key() and written.provenance.verdict == "faster"
    assert [p.provenance.measured_ms for p in outcome.told] == [100.0, 80.0, 90.0]
    assert all(p.provenance.default_measured_ms == 100.0 for p in outcome.told)


@pytest.mark.parametrize(("step_ms", "verdict"), [
    ([100.0, 110.0, 120.0], Verdict.SLOWER),  # no spread: nothing is dropped, the survivor is 10% slower
    (_noisy({False: 1.0}, pct=5.0), Verdict.NO_SIGNIFICANT_DIFFERENCE),  # the same plan twice over, in noise
])
def test_a_survivor_not_confirmed_faster_leaves_fsdp2s_default_written(tmp_path, profile, step_ms, verdict):
    asked, outcome = drive_round(_session(tmp_path, profile), step_ms)
    assert outcome.candidate is not None and outcome.candidate.provenance.verdict == verdict
    assert outcome.written is outcome.told[0] and outcome.written.is_default_for(profile)
    assert Plan.load(tmp_path / "t.plan.json").is_default_for(profile)


def test_every_candidate_dropped_leaves_no_confirmation(tmp_path, profile):
    asked, outcome = drive_round(_session(tmp_path, profile), _noisy({False: 1.5}, pct=2.0))
    assert set(outcome.race.dropped) == {1, 2} and outcome.race.survivor() is None
    assert outcome.candidate is None and outcome.written.is_default_for(profile)
    assert all(p.provenance.verdict is None for p in outcome.told)
    records = {t.number: t for t in study_trials(f"sqlite:///{tmp_path}/t.db", "t").measured}
    assert [records[a.number].race.dropped_after_round for a in asked] == [None, 4, 4]


def test_the_round_starts_with_fsdp2s_default_and_tells_the_trials_it_started(tmp_path, profile):
    session = _session(tmp_path, profile)
    asked = session.prepare()
    with pytest.raises(PlannerError, match="starts with FSDP2's default"):
        session.start(asked[1:])
    session.start(asked)
    with pytest.raises(PlannerError, match="tell the trials the round was started with"):
        session.tell(asked[:2], [[1.0], [1.0]], [[[1.0]], [[1.0]]])
    session.close()


def test_nothing_measured_writes_no_plan(tmp_path, profile):
    session = _session(tmp_path, profile)
    session.prepare()
    outcome = session.finish([], {})
    assert outcome.told == [] and outcome.written is None and outcome.race is None
    assert not (tmp_path / "t.plan.json").exists()
    session.save_profile()
    assert json.loads((tmp_path / "t.profile.json").read_text())["schema_version"] == 1
    session.close()


# --- calibration --------------------------------------------------------------------------------------------------

def test_an_accepted_calibration_is_saved_and_the_next_session_starts_from_it(tmp_path, profile):
    """Six measured plans, each 25% slower than predicted: a fit explains it; the next job of the study uses it."""
    first = _session(tmp_path, profile, measured_trials=5)
    _, outcome = drive_round(first, lambda i, trial: 1.25 * trial.predicted_ms)
    assert len(outcome.told) == 6 and outcome.calibration.accepted, outcome.calibration.reason
    assert outcome.profile.calibration is not None
    first.save_profile()
    assert json.loads((tmp_path / "t.profile.json").read_text())["calibration"] == outcome.profile.calibration

    again = _session(tmp_path, profile, measured_trials=5)
    again.prepare()
    assert again.profile.calibration == outcome.profile.calibration
    assert again.simulator.params == SimParams(**outcome.profile.calibration)
    assert again.simulator.run(Plan.default(profile)).step_ms == pytest.approx(1.25 * outcome.told[0].provenance.
                                                                                 predicted_ms, rel=0.02)
    again.close()
    other_model = _session(tmp_path, dataclasses.replace(profile, fingerprint=dataclasses.replace(
        profile.fingerprint, world_size=4)), measured_trials=5)
    other_model.prepare()
    assert other_model.profile.calibration is None  # made for another world size: not reused
    other_model.close()


def test_a_calibration_that_gains_nothing_is_not_saved(tmp_path, profile):
    """Measured as predicted: no fit beats the uncalibrated model, so none is kept for later jobs."""
    first = _session(tmp_path, profile, measured_trials=5)
    _, outcome = drive_round(first, lambda i, trial: trial.predicted_ms)
    assert not outcome.calibration.accepted and "not below" in outcome.calibration.reason
    assert outcome.profile.calibration is None
    again = _session(tmp_path, profile)
    again.prepare()
    assert again.profile.calibration is None
    again.close()


def test_too_few_measured_plans_are_not_fitted(tmp_path, profile):
    _, outcome = drive_round(_session(tmp_path, profile), [100.0, 80.0, 90.0])
    assert not outcome.calibration.accepted and outcome.calibration.reason.startswith("not fitted: 3 measured plans")


# --- a job that died ----------------------------------------------------------------------------------------------

def test_the_next_session_measures_again_what_a_dead_job_left_running(tmp_path, profile):
    fields = {"heartbeat_interval_s": 1, "grace_period_s": 2, "max_retry": 1}
    dead = _session(tmp_path, profile, **fields)
    left = dead.prepare()
    dead.close()  # the job dies: its heartbeat stops, its trials stay RUNNING
    time.sleep(3.5)
    asked, outcome = drive_round(_session(tmp_path, profile, **fields), lambda i, trial: 100.0 if i == 0 else 90.0)
    assert len(asked) == 5  # the dead job's default and two candidates, re-queued; two new candidates
    retried = [a for a in asked if a.retry_of is not None]
    assert sorted(a.retry_of for a in retried) == sorted(a.number for a in left)
    assert asked[0].plan.is_default_for(profile)  # the re-queued default is the baseline, not measured twice
    assert len({a.plan.behaviour_key() for a in asked}) == len(asked)
    states = [t.state.name for t in study_trials(f"sqlite:///{tmp_path}/t.db", "t").measured]
    assert states.count("RUNNING") == 0 and states.count("FAIL") == len(left)
