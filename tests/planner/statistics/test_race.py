"""The race and the confirmation on synthetic paired measurements (seeded, no ranks).

"10% noise" is what the tool reports as noise: step interquartile range /
median 10%, independent lognormal per step (no shared round effect).
"""

from __future__ import annotations

import math
from collections import Counter
from itertools import pairwise

import numpy as np
import pytest

from planner.statistics.race import Race, RaceSettings, balanced_orders, cycle_rounds, holm
from planner.statistics.schedule import ConfirmSettings, Phase, Schedule
from planner.statistics.verdict import (
    Verdict,
    confirm,
    confirm_launches,
    confirmation_rounds,
    detectable_effect,
    false_faster_rate,
    order_statistic,
    power,
    verdict_of,
)
from planner.testing import synthetic_schedule


def at_most(rate: float, runs: int) -> int:
    """The most events of nominal probability ``rate`` that ``runs`` trials may show: the rate plus 3 standard
    errors (the tests' tolerance for a simulated error rate)."""
    return math.floor(runs * (rate + 3 * math.sqrt(rate * (1 - rate) / runs)))


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_balanced_orders_let_every_plan_follow_every_other_equally_often(n):
    rows = balanced_orders(n)
    assert all(sorted(row) == list(range(n)) for row in rows)
    follows = Counter((a, b) for row in rows for a, b in pairwise(row))
    assert set(follows) == {(a, b) for a in range(n) for b in range(n) if a != b}
    assert len(set(follows.values())) == 1


def test_holm_steps_down():
    assert holm({1: 0.001, 2: 0.02, 3: 0.04}, 0.05) == {1, 2, 3}  # .001 <= .05/3, .02 <= .05/2, .04 <= .05/1
    assert holm({1: 0.001, 2: 0.03, 3: 0.04}, 0.05) == {1}  # .03 > .05/2: stop, .04 is not tested
    assert holm({1: 0.03, 2: 0.04}, 0.05) == set()  # .03 > .05/2
    assert holm({}, 0.05) == set()


def test_over_1000_aa_races_at_most_2_5_percent_end_faster():
    """A/A: two candidates that behave exactly as FSDP2's default; selection, then a fresh confirmation."""
    rng = np.random.default_rng(1)
    runs = [synthetic_schedule([1.0, 1.0, 1.0], 10.0, rng, confirm=ConfirmSettings(launches=0)) for _ in range(1000)]
    faster = sum(s.confirmation is not None and s.confirmation.verdict == Verdict.FASTER for s in runs)
    assert faster <= at_most(0.025, 1000)
    assert sum(s.confirmation is not None for s in runs) >= 950  # almost always something was confirmed


@pytest.mark.parametrize("n", range(4, 41))
def test_the_sign_test_interval_covers_as_it_says_exactly(n):
    """Exact binomial: the interval [d_(k), d_(n+1-k)] misses the median with chance 2 P(B <= k-1), B ~ Bin(n, 1/2);
    each side (the false "faster" side included) at most 2.5%. Under 6 rounds no interval reaches 95%."""
    from scipy.stats import binom

    k = order_statistic(n)
    if n < 6:
        assert k == 0 and false_faster_rate(n) == 0.0
        with pytest.raises(ValueError, match="6 or more paired rounds"):
            confirm([1.0] * n, [1.0] * n, 0.0)
        return
    one_side = binom.cdf(k - 1, n, 0.5)
    assert false_faster_rate(n) == pytest.approx(one_side) and one_side <= 0.025
    assert 1 - 2 * one_side >= 0.95
    assert binom.cdf(k, n, 0.5) > 0.025  # the narrowest such interval: one order statistic further is too few


@pytest.mark.parametrize("n", [8, 13, 23])
@pytest.mark.parametrize("tail", ["normal", "heavy"])
def test_aa_sweep_through_confirm_stays_within_its_nominal_rate(n, tail):
    """4000 A/A confirmations of n rounds: plan and default drawn from one distribution (lognormal, or with a 5%
    chance of a 1.5x stall per step); "faster" at most 2.5% + 3 standard errors."""
    rng = np.random.default_rng(n)
    runs, faster = 4000, 0
    for _ in range(runs):
        times = 100.0 * np.exp(rng.normal(0.0, 0.07, size=(2, n)))
        if tail == "heavy":
            times *= np.where(rng.random((2, n)) < 0.05, 1.5, 1.0)
        faster += confirm(list(times[0]), list(times[1]), 0.0).verdict == Verdict.FASTER
    assert faster <= at_most(0.025, runs)


def test_an_order_effect_does_not_make_a_verdict_over_an_even_confirmation():
    """The step that runs second is 5% slower; alternating order over an even number of rounds keeps the false
    "faster" rate within its nominal 2.5% (Hoeffding's bound on the Poisson-binomial count)."""
    rng = np.random.default_rng(11)
    runs, faster = 4000, 0
    for _ in range(runs):
        plan, default = [], []
        for r in range(12):
            a, b = 100.0 * np.exp(rng.normal(0.0, 0.05, size=2))
            first_is_plan = r % 2 == 0
            plan.append(a * (1.0 if first_is_plan else 1.05))
            default.append(b * (1.05 if first_is_plan else 1.0))
        faster += confirm(plan, default, 0.0).verdict == Verdict.FASTER
    assert faster <= at_most(0.025, runs)


def test_launches_conclude_faster_only_when_every_launch_does():
    fast = ([90.0, 91.0, 89.0, 90.0, 92.0, 90.0], [100.0] * 6)
    mixed = ([90.0, 101.0, 89.0, 90.0, 92.0, 90.0], [100.0] * 6)
    both = confirm_launches([fast, fast], 3.0)
    assert both.verdict == Verdict.FASTER and both.launches == 2 and both.rounds == 12
    hull = confirm_launches([fast, mixed], 3.0)
    assert hull.verdict == Verdict.NO_SIGNIFICANT_DIFFERENCE
    assert hull.ci95 == (pytest.approx(0.89), pytest.approx(1.01))  # the hull of [0.89, 0.92] and [0.89, 1.01]


def test_a_true_5_percent_gain_is_found_by_the_race_at_10_percent_noise():
    """The race (within max_rounds) keeps the candidate 5% faster than the others as its survivor >= 80% of the time."""
    rng = np.random.default_rng(2)
    runs = [synthetic_schedule([1.0, 0.95, 1.0, 1.0], 10.0, rng) for _ in range(300)]
    assert sum(s.race.survivor() == 1 for s in runs) >= 240
    assert all(len(s.race.rounds) <= RaceSettings().max_rounds for s in runs)


@pytest.mark.parametrize("plans,max_rounds", [(4, 12), (3, 12), (5, 24), (2, 8)])
def test_elimination_drops_the_true_best_no_more_often_than_alpha(plans, max_rounds):
    """All plans equal (every one is a true best): any drop is a false one; at most alpha + 3 standard errors."""
    rng = np.random.default_rng(3 + plans)
    settings = RaceSettings(max_rounds=max_rounds)
    equal = [synthetic_schedule([1.0] * plans, 10.0, rng, race=settings) for _ in range(1000)]
    assert sum(bool(s.race.dropped) for s in equal) <= at_most(0.05, 1000)
    assert all(r % cycle_rounds(plans) == 0 for s in equal for r in s.race.looks[:1])  # looks on whole cycles


def test_a_true_best_among_slower_plans_is_kept():
    rng = np.random.default_rng(3)
    best = [synthetic_schedule([1.0, 0.95, 1.05, 1.1], 10.0, rng) for _ in range(300)]
    assert sum(1 in s.race.dropped for s in best) <= at_most(0.05, 300)
    assert sum(3 in s.race.dropped for s in best) >= 100  # the clearly slow one does go


def test_a_carry_over_between_plans_does_not_make_the_race_drop_equal_plans():
    """3 equal plans; the step after plan 1 runs 5% slower (its caches or allocator state). Looks on whole cycles of
    the Williams design weigh the carry-over on every plan alike: drops stay within alpha + 3 standard errors
    (looking every 2 rounds dropped a plan in 12.5% of races)."""
    rng = np.random.default_rng(12)
    sigma = 0.10 / 1.349
    drops = 0
    for _ in range(1000):
        schedule = Schedule(3, RaceSettings(), ConfirmSettings(launches=1), clock=lambda: 0.0)
        while (block := schedule.next_block()) is not None:
            recorded = []
            for order in block:
                times, previous = {}, None
                for p in order:
                    times[p] = 100.0 * (1.05 if previous == 1 else 1.0) * math.exp(rng.normal(0.0, sigma))
                    previous = p
                recorded.append(times)
            schedule.record(recorded)
        drops += bool(schedule.race.dropped)
    assert drops <= at_most(0.05, 1000)


def test_a_candidate_slower_than_the_default_is_dropped_and_the_rest_confirmed():
    rng = np.random.default_rng(4)
    s = synthetic_schedule([1.0, 0.85, 1.4], 5.0, rng)
    assert 2 in s.race.dropped and s.survivor == 1
    assert s.confirmation.verdict == Verdict.FASTER and s.confirmation.ci95[1] < 0.95
    assert s.phase == Phase.DONE


def test_every_candidate_dropped_means_no_confirmation():
    rng = np.random.default_rng(5)
    s = synthetic_schedule([1.0, 1.5, 1.6], 5.0, rng)
    assert sorted(s.race.dropped) == [1, 2]
    assert s.survivor is None and s.confirmation is None and s.next_block() is None


def test_time_budget_stops_the_race():
    now = [0.0]
    s = Schedule(3, RaceSettings(min_rounds=4, block_rounds=2, max_rounds=40, time_budget_s=10.0),
                 ConfirmSettings(min_rounds=6, max_rounds=6), clock=lambda: now[0])
    rng = np.random.default_rng(6)
    while s.phase == Phase.RACE:
        block = s.next_block()
        now[0] += 3.0 * len(block)
        s.record([{p: 100.0 * math.exp(rng.normal(0, 0.05)) for p in order} for order in block])
    assert len(s.race.rounds) == 6  # the first block is a whole cycle of 3 plans; 18 s: over budget
    assert s.phase == Phase.CONFIRM and len(s.next_block()) == 6


def test_drops_are_reported_as_they_happen():
    seen = []
    s = Schedule(3, RaceSettings(), ConfirmSettings(), on_drop=lambda plan, rounds: seen.append((plan, rounds)),
                 clock=lambda: 0.0)
    rng = np.random.default_rng(7)
    while (block := s.next_block()) is not None:
        s.record([{p: 100.0 * (2.0 if p == 2 else 1.0) * math.exp(rng.normal(0, 0.03)) for p in order}
                  for order in block])
    assert seen == [(2, s.race.dropped[2])] and seen[0][1] == cycle_rounds(3)  # min_rounds 4 is one whole cycle


def test_race_rounds_interleave_the_alive_plans_in_balanced_order():
    race = Race(3)
    orders = race.orders(6)
    assert all(sorted(o) == [0, 1, 2] for o in orders)
    assert len({tuple(o) for o in orders}) == 6  # odd n: every row and its reverse


def test_confirmation_rounds_follow_the_noise_within_bounds():
    assert (
        confirmation_rounds(0.001) == 8 and confirmation_rounds(1.0) == 30 and confirmation_rounds(float("nan")) == 30
    )
    middle = confirmation_rounds(0.03, bounds=(6, 1000))
    assert middle % 2 == 0 and 10 < middle < 40
    assert power(middle, 0.03, 0.03) >= 0.8 > power(middle - 2, 0.03, 0.03)  # the fewest even rounds with 80% power
    assert 2.5 * middle < confirmation_rounds(0.06, bounds=(6, 1000)) < 5 * middle  # about 4x for twice the noise
    # what that many rounds find with 80% power is what was asked for
    assert detectable_effect(0.03, middle) == pytest.approx(0.03, rel=0.15) and detectable_effect(0.03, middle) <= 0.03
    assert confirmation_rounds(0.03, bounds=(7, 9)) == 8  # even counts only


def test_order_statistic_and_wide_confirmation_rounds_match_their_definitions():
    """The sign-test order statistic counted up from 0 (its definition), and the fewest even rounds tried one by
    one; the quick paths must give the same answers (a `tune` report once spent minutes counting to n / 2 at every
    n up to 10^4 for a 0.5% effect)."""
    from scipy.stats import binom

    for level in (0.8, 0.95, 0.99):
        for n in range(1, 161):
            k = 0
            while k + 1 <= n // 2 and binom.cdf(k, n, 0.5) <= (1.0 - level) / 2:
                k += 1
            assert order_statistic(n, level) == k, (n, level)
    for sigma, resolve in [(0.05, 0.03), (0.1, 0.02), (0.12, 0.01), (0.03, 0.005)]:
        one_by_one = next(n for n in range(6, 10**4 + 1, 2) if power(n, resolve, sigma) >= 0.8)
        assert confirmation_rounds(sigma, resolve, (6, 10**4)) == one_by_one
    assert confirmation_rounds(0.15, 0.005, (6, 10**4)) == 10**4  # none reaches 80% power: the upper bound


def test_verdict_follows_the_interval():
    assert verdict_of((0.85, 0.93)) == Verdict.FASTER
    assert verdict_of((1.01, 1.2)) == Verdict.SLOWER
    assert verdict_of((0.9, 1.02)) == Verdict.NO_SIGNIFICANT_DIFFERENCE


def test_confirm_is_a_paired_median_with_a_reproducible_interval():
    default = [100.0, 110.0, 95.0, 105.0, 102.0, 98.0, 120.0, 101.0]
    plan = [d * r for d, r in zip(default, [0.9, 0.91, 0.88, 0.9, 0.92, 0.89, 0.9, 0.91], strict=True)]
    c = confirm(plan, default, noise_pct=7.0)
    assert c.ratio == pytest.approx(0.9, abs=1e-9)
    assert c.ci95 == (pytest.approx(0.88), pytest.approx(0.92))  # 8 rounds: k = 1, the extremes
    assert c.verdict == Verdict.FASTER and c.rounds == 8 and c.launches == 1
    with pytest.raises(ValueError, match="6 or more paired rounds"):
        confirm([1.0] * 7, [1.0] * 6, 0.0)


@pytest.mark.parametrize("plans, settings", [
    (2, RaceSettings()), (3, RaceSettings()), (4, RaceSettings()), (5, RaceSettings()), (13, RaceSettings()),
    (3, RaceSettings(min_rounds=4, block_rounds=2, max_rounds=40)), (4, RaceSettings(min_rounds=6, max_rounds=30)),
])
def test_planned_steps_at_each_block_are_the_steps_a_race_without_drops_still_runs(plans, settings):
    """The progress bar's total: asked as a block starts, the schedule's worst case is exact when no plan is dropped
    (it counted the rounds up to ``max_rounds`` rounded up to a whole cycle, past where the race stops)."""
    s = Schedule(plans, settings, ConfirmSettings(launches=2), clock=lambda: 0.0)
    rng = np.random.default_rng(3)
    planned, sizes = [], []
    while (block := s.next_block()) is not None:
        planned.append(s.planned_steps())
        sizes.append(sum(len(order) for order in block))
        s.record([{p: 100.0 * math.exp(rng.normal(0, 0.01)) for p in order} for order in block])
    assert not s.race.dropped  # the premise: equal plans, none dropped at this seed
    assert planned == [sum(sizes[k:]) for k in range(len(sizes))]
    assert s.planned_steps() == 0
