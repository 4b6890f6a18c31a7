"""The first run gains: the survivor applied in the process that measured it, and the watch that keeps it honest.

[Note: Applied in the process that measured it]
Across processes a survivor is faster only once fresh launches say so
([Note: The race's own process] in :mod:`planner.statistics.verdict`). For
the rest of the one process that raced it, the estimand is different: the
plan's total time against FSDP2's default *in this process*, its offset
``delta_l`` included. The confirmation's rounds come after the race, so
the winner's curse (selection on the race's rounds) does not bias them for
that estimand, and the within-process interval (delta method, Student's
``t`` on the rounds: :func:`in_process`) covers it. So the in-loop tuner
applies the survivor for the rest of the process when that interval lies
below 1: a survivor slower here is applied at most 2.5% of the time, one
faster here by its offset may be applied, which is right for this process.
The study still keeps the plan provisional: only "faster" across processes
is written as its recommendation.

[Note: The watch]
A within-process interval cannot cover stalls its rounds did not see, so
the applied plan stays watched: in each block of ``K`` steps, at a position
drawn at random, two steps in a row run FSDP2's default. A step right after
a switch carries the previous plan's state (modules a plan left unsharded
skip the next step's all-gathers; the allocator's cached blocks), so the
first default step and the first plan step after them are washouts, run
and not timed. Block ``i`` gives ``X_i = (mean timed plan step - timed
default step) / m_i``, ``m_i`` the default's mean step before the block
(predictable, so the ``X_i`` are martingale differences): centred at or
below 0 while the plan is not slower in total. The test is always valid: a
normal-mixture sequential probability ratio test (Robbins 1970; Johari,
Pekelis & Walsh 2017, "Always valid inference") on the mean of ``X``, its
variance the blocks' running estimate; the plan is reverted the first time
the statistic reaches ``1 / alpha`` with the mean above 0, and never
otherwise. ``K = floor(2 (1 / r - 1) / COST) + 1`` keeps the two default
steps under :data:`COST` of the run's time at the confirmed ratio ``r``; at
least :data:`MIN_EVERY`, since a stalling plan's steps vary far more than
the default's and many plan steps to one default step find a slower total
sooner. Figures: ``docs/decisions/cluster-spread.md``.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from planner.statistics.launches import launch_estimate
from planner.statistics.looks import ALPHA

# The most of the run's time the watch's default steps may cost ([Note: The watch]).
COST = 0.01
# The watch's error: the chance of ever reverting a plan that is not slower in total, one-sided.
WATCH_ALPHA = 0.1
# The mixing scale of the watch's test, relative step-time difference: it is most sensitive near a 3% slowdown.
MIXING = 0.03
# Blocks before the watch may revert (its variance estimate needs a few).
MIN_BLOCKS = 8
# The fewest and most steps a block of the watch spans ([Note: The watch]: a plan's stalls make its steps vary far
# more than the default's, so a block compares many plan steps with one default step).
MIN_EVERY, MAX_EVERY = 16, 128
# FSDP2's default steps in each block of the watch: a washout, then the timed one.
DEFAULT_STEPS = 2
# The least relative standard deviation the watch's variance estimate is taken at.
MIN_SIGMA = 0.005


class WatchStep(enum.Enum):
    """What one step of a watch block runs, and whether it is timed ([Note: The watch])."""

    PLAN = "plan"  # the applied plan, timed
    DEFAULT_WASHOUT = "default washout"  # FSDP2's default right after a switch, untimed
    DEFAULT = "default"  # FSDP2's default, timed
    PLAN_WASHOUT = "plan washout"  # the plan right after a switch back, untimed

    @property
    def runs_default(self) -> bool:
        """Whether FSDP2's default runs this step."""
        return self in (WatchStep.DEFAULT_WASHOUT, WatchStep.DEFAULT)


@dataclass(frozen=True)
class InProcess:
    """What this process's confirmation rounds say of the survivor here ([Note: Applied in the process that
    measured it]).

    Attributes:
        ratio: the total-time ratio plan / default over the rounds.
        ci95: its 95% interval within this process (delta method, Student's ``t`` on the rounds).
        rounds: paired rounds.
    """

    ratio: float
    ci95: tuple[float, float]
    rounds: int

    @property
    def faster(self) -> bool:
        """Whether the interval lies below 1: the plan is applied for the rest of this process."""
        return self.ci95[1] < 1.0

    def line(self) -> str:
        """``0.812 [0.795, 0.830] within this process over 12 fresh rounds``."""
        return (f"{self.ratio:.3f} [{self.ci95[0]:.3f}, {self.ci95[1]:.3f}] within this process over {self.rounds} "
                "fresh rounds")


def in_process(plan_ms: Sequence[float], default_ms: Sequence[float]) -> InProcess:
    """The survivor against FSDP2's default on this process's confirmation rounds (fresh: after the race).

    Raises:
        ValueError: fewer than ``MIN_ROUNDS`` rounds, lists of different lengths, or a time not positive.
    """
    from scipy.stats import t

    e = launch_estimate(plan_ms, default_ms)
    q = float(t.isf(ALPHA, e.rounds - 1))
    se = math.sqrt(e.variance)
    return InProcess(math.exp(e.log_ratio), (math.exp(e.log_ratio - q * se), math.exp(e.log_ratio + q * se)),
                     e.rounds)


def watch_every(ratio: float, cost: float = COST) -> int:
    """Steps per block of the watch for a plan whose ratio to FSDP2's default is ``ratio``: its default step costs
    less than ``cost`` of the run's time ([Note: The watch]): ``floor(2 (1 / ratio - 1) / cost) + 1`` (two default
    steps a block), within :data:`MIN_EVERY`, :data:`MAX_EVERY`."""
    if not ratio == ratio or ratio <= 0:
        return MIN_EVERY
    extra = max(0.0, 1.0 / ratio - 1.0)
    return int(min(MAX_EVERY, max(MIN_EVERY, math.floor(DEFAULT_STEPS * extra / cost) + 1)))


@dataclass(frozen=True)
class WatchState:
    """Where a watch stands after a block.

    Attributes:
        blocks: blocks checked.
        steps: steps watched (every block's steps).
        ratio: the plan's total-time ratio to the default over the blocks (``nan`` before the first).
        statistic: the mixture likelihood ratio against "not slower" (reverts at ``1 / alpha``).
        reverted: the plan is slower in total here: FSDP2's default from now on.
    """

    blocks: int
    steps: int
    ratio: float
    statistic: float
    reverted: bool

    def line(self) -> str:
        """``ratio 0.812 over 40 checks (1000 steps)``, and the revert when it came."""
        text = f"ratio {self.ratio:.3f} over {self.blocks} checks ({self.steps} steps)"
        if self.reverted:
            text += (f": slower in total here (always-valid test at {100 * WATCH_ALPHA:.0f}%, likelihood ratio "
                     f"{self.statistic:.0f}), FSDP2's default applied")
        return text


@dataclass
class Watch:
    """The applied plan against FSDP2's default, two steps in each block of :attr:`every` ([Note: The watch]).

    Ask :meth:`next_block` for the next block (per step, a :class:`WatchStep`: what runs, and whether it is timed),
    run it, and give :meth:`record` the block's timed plan steps' total and count and its timed default step, ms;
    once :attr:`reverted`, the default stays. Every rank may hold one with the same seed: the positions are the same
    everywhere.

    Attributes:
        every: steps per block (:func:`watch_every` of the confirmed ratio).
        alpha: the test's one-sided error.
        seed: the positions' random stream (the same on every rank).
    """

    every: int
    alpha: float = WATCH_ALPHA
    seed: int = 0
    reverted: bool = False
    _n: int = 0
    _sum_x: float = 0.0
    _sum_x2: float = 0.0
    _plan_ms: float = 0.0
    _plan_steps: int = 0
    _default_ms: float = 0.0
    _steps: int = 0
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        if self.every < MIN_EVERY:
            raise ValueError(f"a watch block spans {MIN_EVERY} steps or more (two default steps, a washout, a timed "
                             f"plan step), found {self.every}")
        self._rng = random.Random(self.seed)

    def next_block(self) -> list[WatchStep]:
        """The next block's steps (:class:`WatchStep`): the plan, with two default steps and the plan's washout at
        a random position (so at least one timed plan step)."""
        k = self._rng.randrange(self.every - 3 + 1)
        out = [WatchStep.PLAN] * self.every
        out[k:k + 3] = [WatchStep.DEFAULT_WASHOUT, WatchStep.DEFAULT, WatchStep.PLAN_WASHOUT]
        return out

    def record(self, plan_ms: float, plan_steps: int, default_ms: float) -> WatchState:
        """One block: its timed plan steps' total time and count, and its timed default step's time, ms.

        Raises:
            ValueError: no plan step, or a time not positive.
        """
        if plan_steps < 1 or plan_ms <= 0 or default_ms <= 0:
            raise ValueError("a watch block needs one plan step or more and positive times")
        scale = self._default_ms / self._n if self._n else default_ms  # the default's mean before this block
        x = (plan_ms / plan_steps - default_ms) / scale
        self._n += 1
        self._sum_x += x
        self._sum_x2 += x * x
        self._plan_ms += plan_ms
        self._plan_steps += plan_steps
        self._default_ms += default_ms
        self._steps += self.every
        state = self.state()
        if state.reverted:
            self.reverted = True
        return state

    def state(self) -> WatchState:
        """Where the watch stands (:class:`WatchState`)."""
        n = self._n
        if n == 0:
            return WatchState(0, 0, float("nan"), 0.0, self.reverted)
        ratio = (self._plan_ms / self._plan_steps) / (self._default_ms / n)
        mean = self._sum_x / n
        variance = (self._sum_x2 - n * mean * mean) / (n - 1) if n > 1 else 0.0
        statistic = mixture_statistic(n, mean, variance)
        slower = n >= MIN_BLOCKS and mean > 0 and statistic >= 1.0 / self.alpha
        return WatchState(n, self._steps, ratio, statistic, self.reverted or slower)


def mixture_statistic(n: int, mean: float, variance: float, mixing: float = MIXING) -> float:
    """The normal-mixture likelihood ratio of the mean of ``n`` increments against 0 ([Note: The watch]):
    ``sqrt(s2 / (s2 + n t2)) exp(n^2 t2 mean^2 / (2 s2 (s2 + n t2)))``, ``s2`` their sample ``variance`` (at
    least :data:`MIN_SIGMA` squared), ``t2 = mixing^2``; 0 below two increments."""
    if n < 2:
        return 0.0
    s2 = max(variance, MIN_SIGMA ** 2)
    t2 = mixing ** 2
    exponent = n * n * t2 * mean * mean / (2 * s2 * (s2 + n * t2))
    return math.sqrt(s2 / (s2 + n * t2)) * math.exp(min(exponent, 700.0))
