"""Calibration recovers known parameters and generalizes to held-back plans."""

from __future__ import annotations

import pytest

from planner.calibrate import Observation, calibrated, errors_pct, fit, spearman
from planner.errors import PlannerError
from planner.plan import Plan
from planner.simulator import SimParams, simulate
from search_spaces import uniform


def _plans(p):
    return [uniform.build(p, f, b, a) for f in range(4) for b in (1, 3) for a in (False, True)]


def test_fit_recovers_ground_truth_and_predicts_held_back_plans(make_profile):
    p = make_profile(n_blocks=6, fwd=[10, 30, 5, 12, 8, 20], bwd=20.0, ag=[8, 4, 15, 6, 9, 5], rs=4.0,
                     optimizer_ms=7.0)
    truth = SimParams(issue_overhead_ms=0.7, overlap_slowdown=1.6, collective_latency_ms=2.5)
    obs = [Observation(plan, simulate(p, plan, truth).step_ms) for plan in _plans(p)]
    # both sync and async plans in each half (the slowdown shows only with overlap)
    train = [o for i, o in enumerate(obs) if i % 3 != 2]
    held = [o for i, o in enumerate(obs) if i % 3 == 2]
    assert {o.plan.unshard_async_op for o in train} == {o.plan.unshard_async_op for o in held} == {False, True}
    before = errors_pct(p, held)
    params = fit(p, train)
    after = errors_pct(p, held, params)
    assert max(abs(e) for e in before) > 5.0  # uncalibrated, the model is off
    assert max(abs(e) for e in after) < 1.0
    assert params.overlap_slowdown == pytest.approx(1.6, abs=0.15)
    # saved with the profile, used by default afterwards
    cp = calibrated(p, params)
    assert cp.calibration["overlap_slowdown"] == params.overlap_slowdown
    assert errors_pct(cp, held) == pytest.approx(after)


def test_fit_needs_two_observations(make_profile):
    p = make_profile()
    with pytest.raises(PlannerError, match="at least 2"):
        fit(p, [Observation(Plan.default(p), 100.0)])


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    # a tie in the prediction shares the average rank instead of taking the order it came in
    assert spearman([1, 1, 3], [10, 20, 30]) == spearman([1, 1, 3], [20, 10, 30]) == pytest.approx(0.866, abs=1e-3)


def test_cross_validation_keeps_the_simple_family_when_it_explains_the_data(make_profile):
    """Truth = compute 1.3x slower, collectives 1.1x: the two-parameter family wins and is recovered."""
    p = make_profile(n_blocks=6, fwd=[10, 30, 5, 12, 8, 20], bwd=20.0, ag=[8, 4, 15, 6, 9, 5], rs=4.0,
                     optimizer_ms=7.0)
    truth = SimParams(compute_scale=1.3, comm_scale=1.1)
    obs = [Observation(plan, simulate(p, plan, truth).step_ms) for plan in _plans(p)[:8]]
    params = fit(p, obs)
    assert params.compute_scale == pytest.approx(1.3, abs=0.02)
    assert params.comm_scale == pytest.approx(1.1, abs=0.05)
    assert (params.issue_overhead_ms, params.overlap_slowdown, params.collective_latency_ms) == (0.0, 1.0, 0.0)
