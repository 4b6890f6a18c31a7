"""bench.fidelity's uncalibrated line: what its figures are measured against."""

import re

from bench.fidelity import _errors
from planner.artifacts.plan import Plan
from planner.simulation.parameters import simulate
from planner.testing import synthetic_profile
from search_spaces import uniform


def _relative(line: str) -> float:
    return float(re.search(r"relative to the default ([0-9.]+)%", line).group(1))


def test_the_ratio_to_the_default_is_paired_round_by_round():
    """A plan at exactly its predicted ratio to the default in two rounds of three, with the rounds' levels apart
    (100, 300, 310 ms), reads 0% relative error; one median against the other would read 48% off."""
    profile = synthetic_profile(n_blocks=3)
    plans = [Plan.default(profile), uniform.build(profile, 1, 1).with_knobs(unshard_async_op=True)]
    ratio = simulate(profile, plans[1]).step_ms / simulate(profile, plans[0]).step_ms
    default = [100.0, 300.0, 310.0]
    plan = [ratio * d * k for d, k in zip(default, (1.0, 1.0, 0.5), strict=True)]
    assert abs(sorted(plan)[1] / sorted(default)[1] / ratio - 1) > 0.4  # the medians' ratio is far off
    assert _relative(_errors(profile, plans, [default, plan])) == 0.0


def test_a_plan_off_its_predicted_ratio_in_every_round_reads_that_far_off():
    profile = synthetic_profile(n_blocks=3)
    plans = [Plan.default(profile), uniform.build(profile, 1, 1).with_knobs(unshard_async_op=True)]
    ratio = simulate(profile, plans[1]).step_ms / simulate(profile, plans[0]).step_ms
    default = [100.0, 300.0, 310.0]
    plan = [1.25 * ratio * d for d in default]
    assert _relative(_errors(profile, plans, [default, plan])) == 20.0  # predicted / measured = 1 / 1.25


def test_the_defaults_level_is_the_prediction_over_its_measured_median():
    """The default measured at 0.8 of its prediction in every round reads +25.0%: the level every plan carries."""
    profile = synthetic_profile(n_blocks=3)
    plans = [Plan.default(profile), uniform.build(profile, 1, 1).with_knobs(unshard_async_op=True)]
    predicted = [simulate(profile, p).step_ms for p in plans]
    line = _errors(profile, plans, [[0.8 * predicted[0]] * 3, [0.8 * predicted[1]] * 3])
    assert re.search(r"the default's level ([+-][0-9.]+)%", line).group(1) == "+25.0"
    assert _relative(line) == 0.0
