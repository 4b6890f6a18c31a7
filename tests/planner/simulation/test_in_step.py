"""The simulator's parameters solved from the profile's in-step timings (planner.simulation.in_step)."""

import dataclasses

import pytest

from planner.artifacts.plan import Plan
from planner.artifacts.profile import InStepTimings, OverlapTimings, Profile
from planner.simulation.calibrate import Observation, calibrate
from planner.simulation.in_step import (
    in_step_params,
    measured_slowdown,
    overlap_slowdown,
    solve_comm_scale,
    solve_overlap_slowdown,
)
from planner.simulation.parameters import simulate
from planner.simulation.simulator import SimParams
from planner.testing import synthetic_profile
from search_spaces import uniform


def _with_in_step(profile: Profile, default_step_ms: float, overlap: OverlapTimings | None = None) -> Profile:
    return dataclasses.replace(profile, in_step=InStepTimings(default_step_ms, overlap))


@pytest.mark.parametrize(("c", "m", "t", "expected"), [
    (100.0, 100.0, 150.0, 1.5),   # equal lengths: the overlap costs half of it
    (100.0, 50.0, 125.0, 1.5),    # compute longer: 50 ms overlapped at 1.5 -> 75 ms, plus 50 alone
    (40.0, 80.0, 100.0, 1.5),     # all-gather longer
    (100.0, 100.0, 90.0, 1.0),    # faster than either alone is noise: no speed-up modelled
    (100.0, 100.0, 400.0, 2.0),   # beyond fair sharing of one core: clipped
])
def test_measured_slowdown_inverts_the_models_overlap_cost(c, m, t, expected):
    timings = OverlapTimings("b0", all_gather_ms=m, compute_ms=c, overlapped_ms=t)
    assert measured_slowdown(timings) == pytest.approx(expected)
    # the simulator takes the slowdown as measured ([Note: The overlap slowdown is used as measured])
    assert overlap_slowdown(timings) == pytest.approx(expected)


def test_comm_scale_recovers_the_scale_the_default_step_was_made_with():
    profile = synthetic_profile(n_blocks=4, fwd=10.0, bwd=20.0, ag=8.0, rs=6.0, optimizer_ms=5.0)
    truth = SimParams(comm_scale=1.3)
    measured = simulate(profile, Plan.default(profile), truth).step_ms
    assert solve_comm_scale(profile, SimParams(), measured) == pytest.approx(1.3, abs=1e-6)


def test_in_step_params_use_measured_overlap_and_solved_comm_scale_on_cpu():
    base = synthetic_profile(n_blocks=4, fwd=10.0, bwd=20.0, ag=8.0, rs=6.0)
    measured = simulate(base, Plan.default(base), SimParams(comm_scale=0.8)).step_ms
    profile = _with_in_step(base, measured, OverlapTimings("b0", all_gather_ms=8.0, compute_ms=10.0,
                                                            overlapped_ms=14.0))
    params = in_step_params(profile)
    assert params.comm_scale == pytest.approx(0.8, abs=1e-6)
    assert params.overlap_slowdown == pytest.approx(1.5)  # 14 ms = 10 + 8 * (s - 1)
    # simulate() without params uses them; an async plan then costs the overlap
    async_plan = uniform.build(profile, 1, 1).with_knobs(unshard_async_op=True)
    assert simulate(profile, async_plan).step_ms == pytest.approx(simulate(profile, async_plan, params).step_ms)
    assert simulate(profile, async_plan).step_ms > simulate(profile, async_plan, dataclasses.replace(
        params, overlap_slowdown=1.0)).step_ms


def test_the_async_defaults_step_sets_the_slowdown_after_comm_scale():
    """[Note: The overlap slowdown from an async step]: a profile whose default and async-default steps were made
    with comm_scale 0.8 and slowdown 1.3 gets both back, where the microbenchmark alone says 1.5; without the async
    step the microbenchmark's stands. Steps below what a free overlap gives, or above fair sharing, clip to 1 and
    2."""
    base = synthetic_profile(n_blocks=4, fwd=10.0, bwd=20.0, ag=8.0, rs=6.0)
    truth = SimParams(comm_scale=0.8, overlap_slowdown=1.3)
    async_default = Plan.default(base).with_knobs(unshard_async_op=True)
    measured = simulate(base, Plan.default(base), truth).step_ms
    measured_async = simulate(base, async_default, truth).step_ms
    bench = OverlapTimings("b0", all_gather_ms=8.0, compute_ms=10.0, overlapped_ms=14.0)  # 1.5
    assert measured_async < simulate(base, async_default, dataclasses.replace(truth, overlap_slowdown=1.5)).step_ms
    profile = dataclasses.replace(base, in_step=InStepTimings(measured, bench, measured_async))
    params = in_step_params(profile)
    assert params.comm_scale == pytest.approx(0.8, abs=1e-6)
    assert params.overlap_slowdown == pytest.approx(1.3, abs=1e-6)
    assert in_step_params(_with_in_step(base, measured, bench)).overlap_slowdown == pytest.approx(1.5)
    assert solve_overlap_slowdown(base, truth, 1.0) == pytest.approx(1.0)
    assert solve_overlap_slowdown(base, truth, 10 * measured_async) == pytest.approx(2.0)
    # GPU: the async step is not used (streams, not shared cores)
    gpu = dataclasses.replace(profile, fingerprint=dataclasses.replace(profile.fingerprint, device_type="cuda"))
    assert in_step_params(gpu).overlap_slowdown == SimParams().overlap_slowdown
    # it round-trips, and a profile without it writes no key
    assert Profile.from_json(profile.to_json()).in_step == profile.in_step
    assert "async_default_step_ms" not in _with_in_step(base, measured, bench).to_json()


def test_a_default_that_hides_its_communication_leaves_comm_scale_alone():
    # GPU: the default prefetches in backward on a separate stream; with communication far below compute
    # the default step does not move with comm_scale, so a measured step says nothing about it.
    base = synthetic_profile(n_blocks=4, fwd=100.0, bwd=200.0, ag=0.01, rs=0.01, device="cuda")
    profile = _with_in_step(base, 2000.0, None)
    assert in_step_params(profile) == SimParams()


def test_profiles_without_in_step_timings_keep_the_defaults_and_round_trip():
    base = synthetic_profile()
    assert in_step_params(base) == SimParams()
    profile = _with_in_step(base, 123.0, OverlapTimings("b0", all_gather_ms=2.0, compute_ms=1.0,
                                                          overlapped_ms=2.5))
    again = Profile.from_json(profile.to_json())
    assert again.in_step == profile.in_step
    assert Profile.from_json(base.to_json()).in_step is None


def test_calibration_starts_from_and_is_pulled_toward_the_in_step_values():
    base = synthetic_profile(n_blocks=4, fwd=10.0, bwd=20.0, ag=8.0, rs=6.0)
    truth = SimParams(comm_scale=1.4, overlap_slowdown=1.5)
    measured = simulate(base, Plan.default(base), truth).step_ms
    profile = _with_in_step(base, measured, OverlapTimings("b0", all_gather_ms=10.0, compute_ms=10.0,
                                                            overlapped_ms=15.0))
    plans = [uniform.build(profile, d, max(1, d)).with_knobs(unshard_async_op=a)
             for d in range(3) for a in (False, True)]
    observations = [Observation(p, simulate(profile, p, truth).step_ms) for p in plans]
    # The in-step values are the truth: no fit can beat them, so none is kept.
    result = calibrate(profile, observations)
    assert result.uncalibrated_error_pct == pytest.approx(0.0, abs=1e-6)
    assert not result.accepted
