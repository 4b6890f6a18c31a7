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

from planner.statistics.race import Race, RaceSettings, balanced_orders, holm
from planner.statistics.schedule import ConfirmSettings, Phase, Schedule
from planner.statistics.verdict import Verdict, confirm, confirmation_rounds, detectable_effect, verdict_of
from planner.testing import synthetic_schedule


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


def test_over_1000_aa_races_at_most_5_percent_end_faster():
    """A/A: two candidates that behave exactly as FSDP2's default; selection, then a fresh confirmation."""
    rng = np.random.default_rng(1)
    runs = [synthetic_schedule([1.0, 1.0, 1.0], 10.0, rng) for _ in range(1000)]
    faster = sum(s.confirmation is not None and s.confirmation.verdict == Verdict.FASTER for s in runs)
    assert faster <= 50
    assert sum(s.confirmation is not None for s in runs) >= 950  # almost always something was confirmed


def test_a_true_5_percent_gain_is_found_by_the_race_at_10_percent_noise():
    """The race (within max_rounds) keeps the candidate 5% faster than the others as its survivor >= 80% of the time."""
    rng = np.random.default_rng(2)
    runs = [synthetic_schedule([1.0, 0.95, 1.0, 1.0], 10.0, rng) for _ in range(300)]
    assert sum(s.race.survivor() == 1 for s in runs) >= 240
    assert all(len(s.race.rounds) <= RaceSettings().max_rounds for s in runs)


def test_elimination_drops_the_true_best_no_more_often_than_alpha():
    """All plans equal (every one is a true best): any drop is a false one. Then a true best among slower plans."""
    rng = np.random.default_rng(3)
    equal = [synthetic_schedule([1.0] * 4, 10.0, rng) for _ in range(1000)]
    assert sum(bool(s.race.dropped) for s in equal) <= 50
    best = [synthetic_schedule([1.0, 0.95, 1.05, 1.1], 10.0, rng) for _ in range(300)]
    assert sum(1 in s.race.dropped for s in best) <= 15
    assert sum(3 in s.race.dropped for s in best) >= 100  # the clearly slow one does go


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
                 ConfirmSettings(min_rounds=4, max_rounds=4), clock=lambda: now[0])
    rng = np.random.default_rng(6)
    while s.phase == Phase.RACE:
        block = s.next_block()
        now[0] += 3.0 * len(block)
        s.record([{p: 100.0 * math.exp(rng.normal(0, 0.05)) for p in order} for order in block])
    assert len(s.race.rounds) == 4  # 12 s after the first block: over budget
    assert s.phase == Phase.CONFIRM and len(s.next_block()) == 4


def test_drops_are_reported_as_they_happen():
    seen = []
    s = Schedule(3, RaceSettings(), ConfirmSettings(), on_drop=lambda plan, rounds: seen.append((plan, rounds)),
                 clock=lambda: 0.0)
    rng = np.random.default_rng(7)
    while (block := s.next_block()) is not None:
        s.record([{p: 100.0 * (2.0 if p == 2 else 1.0) * math.exp(rng.normal(0, 0.03)) for p in order}
                  for order in block])
    assert seen == [(2, s.race.dropped[2])] and seen[0][1] == RaceSettings().min_rounds


def test_race_rounds_interleave_the_alive_plans_in_balanced_order():
    race = Race(3)
    orders = race.orders(6)
    assert all(sorted(o) == [0, 1, 2] for o in orders)
    assert len({tuple(o) for o in orders}) == 6  # odd n: every row and its reverse


def test_confirmation_rounds_follow_the_noise_within_bounds():
    assert (
        confirmation_rounds(0.001) == 8 and confirmation_rounds(1.0) == 30 and confirmation_rounds(float("nan")) == 30
    )
    middle = confirmation_rounds(0.03, bounds=(1, 1000))
    assert 10 < middle < 40
    assert confirmation_rounds(0.06, bounds=(1, 1000)) == pytest.approx(4 * middle, rel=0.1)
    # what that many rounds resolve is what was asked for
    assert detectable_effect(0.03, middle) == pytest.approx(0.03, rel=0.08)


def test_verdict_follows_the_interval():
    assert verdict_of((0.85, 0.93)) == Verdict.FASTER
    assert verdict_of((1.01, 1.2)) == Verdict.SLOWER
    assert verdict_of((0.9, 1.02)) == Verdict.NO_SIGNIFICANT_DIFFERENCE


def test_confirm_is_a_paired_median_with_a_reproducible_interval():
    default = [100.0, 110.0, 95.0, 105.0, 102.0, 98.0, 120.0, 101.0]
    plan = [d * r for d, r in zip(default, [0.9, 0.91, 0.88, 0.9, 0.92, 0.89, 0.9, 0.91], strict=True)]
    c = confirm(plan, default, noise_pct=7.0, seed=3)
    assert c.ratio == pytest.approx(0.9, abs=1e-9)
    assert c.ci95[0] <= c.ratio <= c.ci95[1] < 1.0 and c.verdict == Verdict.FASTER and c.rounds == 8
    assert confirm(plan, default, 7.0, seed=3) == c
    with pytest.raises(ValueError, match="2 or more paired rounds"):
        confirm([1.0], [1.0], 0.0)
