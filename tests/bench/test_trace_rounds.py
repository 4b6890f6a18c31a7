"""bench.trace_rounds' recompute line: the checkpointed modules' recompute, trace against recorder."""

import dataclasses

from bench.trace_rounds import median_profile, recompute_line
from planner.testing import synthetic_profile


def _with_recompute(profile, recompute_ms: dict[str, float]):
    modules = {q: dataclasses.replace(m, recompute_ms=recompute_ms.get(q, 0.0)) for q, m in profile.modules.items()}
    return dataclasses.replace(profile, modules=modules)


def test_the_recompute_is_compared_on_the_modules_the_recorder_saw_recompute():
    base = synthetic_profile(n_blocks=4)
    recorded = _with_recompute(base, {"b0": 10.0, "b2": 20.0})  # selective: every other block
    traced = _with_recompute(base, {"b0": 9.0, "b2": 26.0, "b3": 1.0})

    line, error = recompute_line(traced, recorded)
    assert error == 20.0  # |9/10 - 1| = 10%, |26/20 - 1| = 30%: the median
    assert "the 2 modules" in line and "35.0 ms a step traced against 30.0 recorded" in line
    assert "traced in 1 other module(s)" in line


def test_no_recompute_line_without_checkpointing():
    base = synthetic_profile(n_blocks=2)
    assert recompute_line(base, base) is None


def test_the_recorders_median_over_rounds_takes_the_recompute_too():
    base = synthetic_profile(n_blocks=2)
    base = dataclasses.replace(base, measured_step_ms=100.0)
    rounds = [_with_recompute(base, {"b0": ms}) for ms in (30.0, 10.0, 12.0)]
    assert median_profile(rounds).modules["b0"].recompute_ms == 12.0
