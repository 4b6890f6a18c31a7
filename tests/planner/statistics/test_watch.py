"""The first run gains: the in-loop tuner's survivor applied in the process that measured it, and the watch, on
synthetic rounds (no ranks): ``planner.testing.chains.first_run`` runs the race and the confirmation through the
product's ``Schedule`` under the in-loop tuner's own settings, the in-process decision and the watch.

Each rate is over ``RUNS`` seeded draws, held to its bound plus 3 standard errors (``at_most``), a power to its
target less 3 (``at_least``). Steps: 1% noise of their own, a slow drift of the machine's speed (3%, step-to-step
correlation 0.95) that whatever runs at that moment shares.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from planner.statistics.watch import (
    COST,
    DEFAULT_STEPS,
    MAX_EVERY,
    MIN_BLOCKS,
    MIN_EVERY,
    WATCH_ALPHA,
    Watch,
    WatchStep,
    in_process,
    mixture_statistic,
    watch_every,
)
from planner.testing.chains import at_least, at_most, first_run

RUNS = 400


@pytest.mark.parametrize("candidates", [3, 5])
def test_with_nothing_to_gain_the_survivor_is_applied_in_process_at_most_5_percent(candidates):
    rng = np.random.default_rng(candidates)
    runs = [first_run(rng, [1.0] * (candidates + 1), watch_steps=0) for _ in range(RUNS)]
    assert sum(r.applied for r in runs) <= at_most(0.05, RUNS)


@pytest.mark.parametrize("candidates", [3, 5])
def test_a_survivor_slower_in_this_process_is_applied_at_most_2_5_percent(candidates):
    """Offsets per plan and per process (tau 0.04): a survivor slower here (its offset above 0) is applied at most
    2.5% of the time; one faster here by its offset may be, which is right for this process: most of those 2% or
    more faster are."""
    rng = np.random.default_rng(10 + candidates)
    runs = [first_run(rng, [1.0] * (candidates + 1), tau=0.04, watch_steps=0) for _ in range(RUNS)]
    assert sum(r.applied and r.offset > 0 for r in runs) <= at_most(0.025, RUNS)
    faster_here = [r for r in runs if r.offset < -0.02]
    assert len(faster_here) > RUNS / 4 and sum(r.applied for r in faster_here) >= 0.8 * len(faster_here)


def test_candidates_all_slower_here_are_applied_at_most_2_5_percent():
    """Every candidate 1% slower in this process: whichever survives is slower here, and is applied at most 2.5% of
    the time (the within-process interval's one-sided error)."""
    rng = np.random.default_rng(21)
    runs = [first_run(rng, [1.0, 1.01, 1.01, 1.01], watch_steps=0) for _ in range(RUNS)]
    assert sum(r.applied for r in runs) <= at_most(0.025, RUNS)


def test_the_stall_plan_is_still_applied_after_500_watched_steps_at_most_5_percent():
    """2% faster on most steps, 1.5x on one in ten: 2.9% slower in total. The confirmation's rounds miss its stalls
    often enough to apply it; the watch reverts it."""
    rng = np.random.default_rng(31)
    runs = [first_run(rng, [1.0, 0.98], stall_p=[0.0, 0.1], watch_steps=500) for _ in range(RUNS)]
    assert sum(r.applied for r in runs) > 0.1 * RUNS  # the watch has work to do
    assert sum(r.applied_at_end for r in runs) <= at_most(0.05, RUNS)


def test_a_true_10_percent_gain_is_applied_in_the_first_run_at_least_90_percent():
    rng = np.random.default_rng(41)
    runs = [first_run(rng, [1.0, 0.9, 1.0], watch_steps=500) for _ in range(RUNS // 2)]
    assert sum(r.applied_at_end and r.survivor == 1 for r in runs) >= at_least(0.9, RUNS // 2)


def _watched(watch: Watch, steps: int, plan_ms, default_ms) -> int | None:
    """Run ``watch`` for ``steps`` steps, each a call of ``plan_ms()`` or ``default_ms()`` for what it runs, and
    return the step count at which it reverted (``None``: never). Washout steps run and are not timed."""
    while watch.state().steps < steps:
        plan, n, default = 0.0, 0, 0.0
        for kind in watch.next_block():
            ms = default_ms() if kind.runs_default else plan_ms()
            if kind is WatchStep.DEFAULT:
                default = ms
            elif kind is WatchStep.PLAN:
                plan, n = plan + ms, n + 1
        state = watch.record(plan, n, default)
        if state.reverted:
            return state.steps
    return None


def test_a_block_runs_the_default_twice_the_first_a_washout_then_a_plan_washout():
    """Every block: ``every`` steps, the default twice in a row (a washout, then the timed step), the plan's washout
    right after them, the rest timed plan steps; the position varies from block to block and is the same for the
    same seed (every rank draws the same blocks)."""
    watch, again = Watch(MIN_EVERY, seed=7), Watch(MIN_EVERY, seed=7)
    starts = set()
    for _ in range(200):
        block = watch.next_block()
        assert block == again.next_block() and len(block) == MIN_EVERY
        k = block.index(WatchStep.DEFAULT_WASHOUT)
        assert block[k:k + 3] == [WatchStep.DEFAULT_WASHOUT, WatchStep.DEFAULT, WatchStep.PLAN_WASHOUT]
        assert sum(step.runs_default for step in block) == DEFAULT_STEPS
        assert block.count(WatchStep.PLAN) == MIN_EVERY - 3
        starts.add(k)
    assert starts == set(range(MIN_EVERY - 2))
    with pytest.raises(ValueError, match="16 steps or more"):
        Watch(MIN_EVERY - 1)


def test_the_watch_never_reverts_a_plan_not_slower_more_often_than_its_alpha():
    """A plan exactly as fast as the default, watched for 2000 steps in the shortest blocks with a drifting machine:
    ever reverted at most the watch's alpha (the always-valid test: every block is a look)."""
    rng = np.random.default_rng(51)
    runs = 300
    speed = [0.0]

    def step() -> float:
        speed[0] = 0.95 * speed[0] + math.sqrt(1 - 0.95 ** 2) * rng.normal(0.0, 0.03)
        return 100.0 * math.exp(speed[0] + rng.normal(0.0, 0.01))

    reverted = sum(_watched(Watch(MIN_EVERY, seed=seed), 2000, step, step) is not None for seed in range(runs))
    assert reverted <= at_most(WATCH_ALPHA, runs)


def test_the_watch_ignores_what_a_switch_carries_into_the_next_step():
    """A step right after a switch runs at the previous plan's speed (the carry [Note: The watch] names): a plan 5%
    slower is still found slower, because only steps after a washout are timed; the carried step alone would make
    the plan look as fast as the default."""
    rng = np.random.default_rng(71)
    found, last = 0, ["plan"]

    def run(which: str) -> float:
        carried, last[0] = last[0], which
        base = 105.0 if carried == "plan" else 100.0  # the first step after a switch: the previous plan's speed
        return base * math.exp(rng.normal(0.0, 0.01))

    for seed in range(50):
        found += _watched(Watch(MIN_EVERY, seed=seed), 2000, lambda: run("plan"), lambda: run("default")) is not None
    assert found == 50


def test_the_watch_reverts_a_plan_5_percent_slower_within_a_few_hundred_steps():
    rng = np.random.default_rng(61)
    every = watch_every(0.95)
    when = [_watched(Watch(every, seed=seed), 2000, lambda: 105.0 * math.exp(rng.normal(0.0, 0.01)),
                     lambda: 100.0 * math.exp(rng.normal(0.0, 0.01))) for seed in range(100)]
    assert None not in when and np.median(when) <= 300 and min(when) >= MIN_BLOCKS * every


def test_the_watchs_default_steps_cost_under_1_percent_at_the_measured_ratio():
    """``K = floor(2 (1 / r - 1) / COST) + 1`` (two default steps a block): on the reference Llama's 0.80 one block
    of 51 steps; a plan near the default's speed is checked in the shortest blocks, which costs nearly nothing."""
    assert watch_every(0.80) == 51 and watch_every(0.98) == MIN_EVERY and watch_every(1.0) == MIN_EVERY
    assert watch_every(0.3) == MAX_EVERY and watch_every(float("nan")) == MIN_EVERY
    for ratio in (0.5, 0.8, 0.9, 0.95, 0.99):
        k = watch_every(ratio)
        assert k == MAX_EVERY or DEFAULT_STEPS * (1 / ratio - 1) / k < COST


def test_the_in_process_interval_is_the_launchs_own_delta_method_interval():
    plan, default = [80.0, 82.0, 79.0, 81.0, 80.5, 79.5], [100.0, 101.0, 99.0, 100.5, 99.5, 100.0]
    here = in_process(plan, default)
    assert here.ratio == pytest.approx(sum(plan) / sum(default)) and here.faster and here.rounds == 6
    assert here.ci95[0] < here.ratio < here.ci95[1] < 0.82


def test_the_mixture_statistic_is_robbins_normal_mixture():
    """At n increments of mean m and variance s2, mixing t2: sqrt(s2 / (s2 + n t2)) exp(n^2 t2 m^2 / (2 s2 (s2 + n
    t2))); 0 below two increments; the variance taken at its floor when smaller."""
    n, m, s2, t2 = 50, 0.01, 0.02 ** 2, 0.03 ** 2
    expected = math.sqrt(s2 / (s2 + n * t2)) * math.exp(n * n * t2 * m * m / (2 * s2 * (s2 + n * t2)))
    assert mixture_statistic(n, m, s2) == pytest.approx(expected)
    assert mixture_statistic(1, 1.0, 1.0) == 0.0
    assert mixture_statistic(10, 0.0, 0.0) == mixture_statistic(10, 0.0, 0.005 ** 2)
