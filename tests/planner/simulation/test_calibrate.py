"""Calibration recovers known parameters, generalizes to held-back plans, and is kept only when physical."""

from __future__ import annotations

import math

import numpy as np
import pytest

from planner.artifacts.plan import Plan
from planner.errors import PlannerError
from planner.simulation.calibrate import (
    FAMILIES,
    Observation,
    calibrate,
    calibrated,
    errors_pct,
    fit,
    fit_family,
    min_observations,
    noise_floor_pct,
    spearman,
)
from planner.simulation.parameters import simulate
from planner.simulation.simulator import SimParams
from search_spaces import uniform


def _plans(p):
    return [uniform.build(p, f, b).with_knobs(unshard_async_op=a)
            for f in range(4) for b in (1, 3) for a in (False, True)]


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
    # sync and async plans, with and without resharding after forward: the first 8 of _plans predict only 3
    # distinct steps, which the overlap family fits as well
    plans = [uniform.build(p, f, b, reshard_after_forward=r).with_knobs(unshard_async_op=a) for f, b, a, r in (
        (0, 1, False, True), (1, 1, True, True), (1, 3, True, True), (2, 1, True, True), (0, 1, False, False),
        (1, 1, True, False), (3, 3, True, False), (2, 2, True, True))]
    obs = [Observation(plan, simulate(p, plan, truth).step_ms) for plan in plans]
    params = fit(p, obs)
    assert params.compute_scale == pytest.approx(1.3, abs=0.02)
    assert params.comm_scale == pytest.approx(1.1, abs=0.05)
    assert (params.issue_overhead_ms, params.overlap_slowdown, params.collective_latency_ms) == (0.0, 1.0, 0.0)


def _noisy(p, plans, truth, noise, seed):
    rng = np.random.default_rng(seed)
    return [Observation(plan, simulate(p, plan, truth).step_ms * (1.0 + rng.normal(0.0, noise))) for plan in plans]


def _cpu_profile(make_profile):
    return make_profile(n_blocks=6, fwd=[10, 30, 5, 12, 8, 20], bwd=20.0, ag=[8, 4, 15, 6, 9, 5], rs=4.0,
                        optimizer_ms=7.0)


def test_holdout_like_case_saves_no_calibration(make_profile):
    """The issue's holdout: FSDP2's default and 4 candidates the model ties, measured ~20% above the prediction."""
    p = _cpu_profile(make_profile)
    tied = [uniform.build(p, f, b).with_knobs(unshard_async_op=True) for f, b in ((1, 1), (2, 1), (3, 1), (1, 2))]
    predicted = {simulate(p, plan).step_ms for plan in tied}
    assert len({round(x, 6) for x in predicted}) <= 2  # the model (nearly) ties them
    obs = _noisy(p, [Plan.default(p), *tied], SimParams(compute_scale=1.25), 0.03, seed=1)
    result = calibrate(p, obs)
    assert not result.accepted and result.params is None
    assert result.reason.startswith("not fitted: 5 measured plans, a fit needs at least 6")
    assert result.apply(calibrated(p, SimParams(comm_scale=2.0))).calibration is None  # nothing to save or reuse


def test_a_fit_on_a_bound_is_rejected(make_profile):
    """Collectives 10x faster in the step than measured alone: comm_scale would go below 0.25; not physical."""
    p = _cpu_profile(make_profile)
    obs = [Observation(plan, simulate(p, plan, SimParams(comm_scale=0.05)).step_ms) for plan in _plans(p)]
    result = calibrate(p, obs)
    assert not result.accepted and "comm_scale" in result.reason and "on its bound 0.25" in result.reason


def test_a_fit_at_a_physical_limit_is_judged_by_its_held_out_error(make_profile):
    """The microbenchmark says the overlap costs 1.8, the step says it costs nothing (as on the reference Llama,
    the collectives first): ``overlap_slowdown`` fits its lower bound, 1, which is what "no slowdown" means, not a
    guard."""
    import dataclasses

    from planner.artifacts.profile import InStepTimings, OverlapTimings
    from planner.simulation.in_step import in_step_params

    base = _cpu_profile(make_profile)
    p = dataclasses.replace(base, in_step=InStepTimings(
        simulate(base, Plan.default(base), SimParams()).step_ms,
        OverlapTimings("b0", all_gather_ms=100.0, compute_ms=100.0, overlapped_ms=180.0)))
    assert in_step_params(p).overlap_slowdown == pytest.approx(1.8)
    # as there, the async plans run faster than even a free overlap explains: the fit wants below 1
    obs = [Observation(o.plan, o.measured_ms * (0.9 if o.plan.unshard_async_op else 1.0))
           for o in _noisy(p, _plans(p)[:10], SimParams(overlap_slowdown=1.0), 0.01, seed=5)]
    result = calibrate(p, obs)
    assert result.accepted, result.reason
    # on the bound, within the 1% of its range that the guard rule uses: kept all the same
    assert "overlap_slowdown" in result.family and result.params.overlap_slowdown == pytest.approx(1.0, abs=0.01)
    assert result.loo_error_pct < result.uncalibrated_error_pct


def test_a_fit_that_does_not_beat_the_uncalibrated_model_is_rejected(make_profile):
    """The model is right and the measurements only noisy: no family predicts held-out plans better."""
    p = _cpu_profile(make_profile)
    obs = _noisy(p, _plans(p)[:8], SimParams(), 0.04, seed=3)
    result = calibrate(p, obs)
    assert not result.accepted
    assert "does not beat the in-step parameters'" in result.reason and "measurement noise at 8 plans" in result.reason
    assert result.uncalibrated_error_pct - result.loo_error_pct <= noise_floor_pct(3.0, 8)


def test_the_noise_floor_shrinks_with_the_plans_measured(make_profile):
    assert noise_floor_pct(3.0, 4) == pytest.approx(math.sqrt(math.pi / 2) * 1.5)
    assert noise_floor_pct(3.0, 16) == pytest.approx(noise_floor_pct(3.0, 4) / 2)
    # a real 30% misfit is far above the floor of noisy measurements; the same data called 40% noisy is not
    p = _cpu_profile(make_profile)
    obs = _noisy(p, _plans(p)[:8], SimParams(compute_scale=1.3, comm_scale=1.1), 0.01, seed=4)
    assert calibrate(p, obs, measurement_error_pct=1.0).accepted
    assert not calibrate(p, obs, measurement_error_pct=60.0).accepted  # floor 26.6 points > the 18.6 gained


def test_an_accepted_fit_reports_leave_one_out_error_and_is_regularized(make_profile):
    p = _cpu_profile(make_profile)
    obs = _noisy(p, _plans(p), SimParams(compute_scale=1.3, comm_scale=1.1), 0.01, seed=4)
    result = calibrate(p, obs)
    assert result.accepted and result.family == ("compute_scale", "comm_scale")
    assert result.loo_error_pct < result.uncalibrated_error_pct
    assert result.reason.startswith(f"accepted: cross-validated error {result.loo_error_pct:.1f}%")
    assert result.params.compute_scale == pytest.approx(1.3, abs=0.03)
    # the prior pulls a parameter the data cannot see back to its uncalibrated value
    few = [o for o in obs if not o.plan.unshard_async_op][:6]
    sync_only = fit_family(p, few, ("compute_scale", "comm_scale", "overlap_slowdown"))
    assert sync_only.overlap_slowdown == pytest.approx(1.0, abs=1e-3)


def test_families_need_clearly_more_observations_than_parameters():
    assert [min_observations(f) for f in FAMILIES] == [6, 8, 12]
