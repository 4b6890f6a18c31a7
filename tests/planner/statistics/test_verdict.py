"""The confirmation's verdict on synthetic launches (seeded, no ranks): its error rates, its power, its pieces.

The launches come from ``planner.testing.LaunchModel``: 24 paired rounds a
launch, each plan's own step noise 4%, a slowness both plans share in a
round (which pairing cancels), and a between-launch spread ``tau`` of the
plan's log ratio, as in issue "Verdicts that hold across restarts".
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from planner.statistics.schedule import confirmation_orders
from planner.statistics.verdict import (
    DEFAULT_SPREAD,
    MAX_LAUNCHES,
    Spread,
    Verdict,
    confirm,
    confirm_launches,
    confirmation_rounds,
    detectable_gain,
    launch_estimate,
    power,
    verdict_of,
)
from planner.testing import LaunchModel, as_launches, at_most

RUNS = 2000


def faster_rate(model: LaunchModel, launches: int, seed: int, runs: int = RUNS) -> int:
    """How many of ``runs`` synthetic confirmations of ``launches`` launches are called faster."""
    drawn = model.draw(runs, launches, seed)
    return sum(confirm_launches(as_launches(c), 0.0).verdict == Verdict.FASTER for c in drawn)


@pytest.mark.parametrize("tau", [0.02, 0.04])
@pytest.mark.parametrize("launches", [1, 2, 3])
def test_a_plan_no_faster_is_called_faster_at_most_2_5_percent(tau, launches):
    """A/A with a between-launch spread: the plan's true total time equals the default's in a typical launch."""
    assert faster_rate(LaunchModel(tau=tau), launches, seed=launches + int(100 * tau)) <= at_most(0.025, RUNS)


@pytest.mark.parametrize("launches", [1, 2, 3])
def test_a_plan_faster_on_most_steps_that_stalls_is_not_called_faster(launches):
    """2% faster on most steps, 1.5x its own step on one in ten: 2.9% slower in total (1% step noise)."""
    model = LaunchModel(gain=0.02, tau=0.02, noise=0.01, stall_p=0.1)
    assert model.total_ratio > 1.02
    assert faster_rate(model, launches, seed=20 + launches) <= at_most(0.025, RUNS)


@pytest.mark.parametrize("launches", [1, 2, 3])
def test_the_interval_covers_the_total_time_ratio_with_heavy_tails_and_stalls(launches):
    """Equal total time by construction (4.8% faster on most steps, 1.5x stalls on one step in ten), a spread near
    the prior: the interval holds the true ratio at least 95% of the time, less 3 standard errors."""
    model = LaunchModel(gain=1 - 1 / 1.05, tau=0.04, noise=0.04, stall_p=0.1)
    assert model.total_ratio == pytest.approx(1.0)
    drawn = model.draw(RUNS, launches, seed=30 + launches)
    missed = 0
    for c in drawn:
        low, high = confirm_launches(as_launches(c), 0.0).ci95
        missed += not low <= model.total_ratio <= high
    assert missed <= at_most(0.05, RUNS)


@pytest.mark.parametrize("gain, launches", [(0.10, 2), (0.07, 3)])
def test_a_real_gain_is_called_faster_with_80_percent_power(gain, launches):
    """tau = 0.02: a verdict that never said "faster" would fail here."""
    assert faster_rate(LaunchModel(gain=gain, tau=0.02), launches, seed=40 + launches) >= 0.8 * RUNS


def test_restarts_that_look_at_every_launch_stay_within_2_5_percent():
    """The in-loop tuner's path: a verdict at 1 launch, then at 2 and 3 as restarts add launches
    ([Note: Provisional verdicts]); "faster" at any of the looks counts. tau = 0.04."""
    drawn = LaunchModel(tau=0.04).draw(RUNS, MAX_LAUNCHES, seed=50)
    ever = 0
    for c in drawn:
        launches = as_launches(c)
        ever += any(confirm_launches(launches[:k], 0.0).verdict == Verdict.FASTER for k in range(1, MAX_LAUNCHES + 1))
    assert ever <= at_most(0.025, RUNS)


def test_power_follows_the_model_it_states():
    """At a spread equal to the prior's, the formula's power matches the simulated rate within 5 points."""
    for gain, launches in [(0.10, 1), (0.10, 2), (0.07, 3)]:
        model = LaunchModel(gain=gain, tau=DEFAULT_SPREAD.tau, shared=0.0)
        sigma = math.sqrt(2) * model.noise
        simulated = faster_rate(model, launches, seed=60 + launches, runs=1000) / 1000
        assert power(launches, model.rounds, gain, sigma) == pytest.approx(simulated, abs=0.05), (gain, launches)
    assert detectable_gain(2, 24, 0.057) == pytest.approx(
        next(g / 1000 for g in range(1, 500) if power(2, 24, g / 1000, 0.057) >= 0.8), abs=0.001)


def test_the_estimand_is_total_time_not_the_median_round():
    default = [100.0] * 10
    plan = [95.0] * 9 + [200.0]  # faster on 9 rounds of 10, one stall
    e = launch_estimate(plan, default)
    assert math.exp(e.log_ratio) == pytest.approx(1055 / 1000)
    c = confirm(plan, default, 0.0)
    assert c.ratio == pytest.approx(1.055) and c.median_ratio == pytest.approx(0.95)
    assert c.verdict != Verdict.FASTER and c.total_time
    with pytest.raises(ValueError, match="4 or more paired rounds"):
        launch_estimate([1.0] * 3, [1.0] * 3)
    with pytest.raises(ValueError, match="4 or more paired rounds"):
        launch_estimate([1.0] * 6, [1.0] * 5)


def test_one_launch_clears_the_spread_only_with_a_large_gain():
    """Rounds 10% faster with 1% noise clear a 4.5% spread; rounds 4% faster are faster in this launch only."""
    rng = np.random.default_rng(7)
    default = list(100 * np.exp(rng.normal(0, 0.01, 24)))
    big = confirm([d * 0.85 for d in default], default, 1.0)
    small = confirm([d * 0.96 * math.exp(rng.normal(0, 0.01)) for d in default], default, 1.0)
    assert big.verdict == Verdict.FASTER and big.launches == 1
    assert small.verdict == Verdict.PROVISIONAL and small.within_ci95[1] < 1.0 < small.ci95[1]
    assert "provisional" in small.line() and "1 launch" in small.line()
    # at MAX_LAUNCHES launches a verdict that would be provisional is no difference: the default returns
    assert verdict_of(small.ci95, small.within_ci95, MAX_LAUNCHES) == Verdict.NO_SIGNIFICANT_DIFFERENCE
    assert verdict_of((0.85, 0.93)) == Verdict.FASTER and verdict_of((1.01, 1.2)) == Verdict.SLOWER


def test_the_spread_pools_the_prior_with_the_study_evidence():
    agreeing = [launch_estimate([90.0 + i % 2 for i in range(24)], [100.0] * 24) for _ in range(4)]
    disagreeing = [launch_estimate([f * (100.0 + i % 2) for i in range(24)], [100.0] * 24)
                   for f in (0.8, 1.0, 0.9, 1.1)]
    lower, higher = DEFAULT_SPREAD.updated([agreeing]), DEFAULT_SPREAD.updated([disagreeing])
    assert lower.tau < DEFAULT_SPREAD.tau < higher.tau and lower.df == higher.df == DEFAULT_SPREAD.df + 3
    assert DEFAULT_SPREAD.updated([agreeing[:1]]) == DEFAULT_SPREAD  # one launch says nothing of the spread
    y = np.log([0.8, 1.0, 0.9, 1.1])
    expected = (DEFAULT_SPREAD.df * DEFAULT_SPREAD.tau ** 2 + 3 * (y.var(ddof=1) - np.mean(
        [e.variance for e in disagreeing]))) / (DEFAULT_SPREAD.df + 3)
    assert higher.tau == pytest.approx(math.sqrt(expected), rel=1e-3)


def test_a_smaller_spread_narrows_the_interval_and_more_launches_need_fewer_rounds():
    launches = as_launches(LaunchModel(gain=0.05).draw(1, 2, seed=3)[0])
    wide = confirm_launches(launches, 0.0)
    narrow = confirm_launches(launches, 0.0, Spread(0.01, 50))
    assert narrow.ci95[1] - narrow.ci95[0] < wide.ci95[1] - wide.ci95[0]
    assert confirmation_rounds(0.05, 0.10, (6, 200), launches=3) <= confirmation_rounds(0.05, 0.10, (6, 200))
    assert confirmation_rounds(0.001) == 8 and confirmation_rounds(float("nan")) == 30
    # where the spread dominates, more rounds stop helping: the sizing stops short of the bound
    assert confirmation_rounds(0.05, 0.03, (6, 1000), launches=2) < 1000


def test_confirmation_orders_run_both_orders_in_each_pair_the_first_drawn_at_random():
    orders = confirmation_orders((3, 0), 24, random.Random(1))
    pairs = [(tuple(orders[i]), tuple(orders[i + 1])) for i in range(0, 24, 2)]
    assert all(a == b[::-1] and sorted(a) == [0, 3] for a, b in pairs)
    assert len({a for a, _ in pairs}) == 2  # both orders come first somewhere: not a fixed alternation
    assert len(confirmation_orders((1, 0), 7)) == 7
