"""The confirmation: the race's survivor against FSDP2's default on fresh rounds, and the verdict.

The race selects; selecting on noisy medians favours the luckiest plan (the
winner's curse), so the figure the tool reports comes from rounds the
selection never saw. The survivor and the default run again, interleaved
(order alternating, an even number of rounds), in one or more launches;
the reported figure is the median of the per-round ratios survivor/default
with a distribution-free interval ([Note: The sign-test interval]), and the
verdict follows from the interval alone.

[Note: The sign-test interval]
Per round ``d = log(plan / default)``. The interval for the median of ``d``
is the pair of order statistics ``[d_(k), d_(n+1-k)]``, ``k`` the largest with
``P(Binomial(n, 1/2) <= k - 1) <= 0.025`` (the sign test inverted; Hollander,
Wolfe & Chicken, *Nonparametric Statistical Methods*, 3.6). Why this one:
- it needs no model of the step-time distribution. Our per-round ratios are
  skewed and heavy-tailed (a stall in one step of a pair), where a
  t-interval's coverage depends on the tails, and the percentile bootstrap
  of the median, which this replaces, undercovers at small n (4.6% false
  "faster" at 13 rounds, 6.6% at 4, against 2.5% claimed);
- its error is exact: if the plan is no faster (``P(d < 0) <= 1/2``), the
  chance of the verdict "faster" is ``P(Binomial(n, 1/2) >= n + 1 - k)``, at
  most 2.5% at every n; :func:`false_faster_rate` computes it and the tests
  check it for n = 6..40;
- the order each round runs the two plans in alternates over an even number
  of rounds. An order effect makes ``P(d < 0)`` ``1/2 + e`` in one half of the
  rounds and ``1/2 - e`` in the other: the count of negative rounds is then
  a Poisson-binomial of mean ``n/2``, whose upper tail beyond ``n/2 + 1`` is at
  most the binomial's (Hoeffding 1956, Theorem 4), so the error stays <= 2.5%.
The price is discreteness: at fewer than 6 rounds no pair of order
statistics reaches 95%, so a confirmation needs 6 rounds or more, and at 8
rounds "faster" needs all 8 ratios below 1.

[Note: Confirming across launches]
A process's rounds share its state (allocator, caches, where the OS put its
threads), so an interval from one process describes that process; the
user's next job is another, and a plan's gain moves from process to
process by more than one process's interval admits. The
confirmation therefore runs in ``L`` fresh launches (new processes, models
built afresh, each plan on its own model instance from its first step, as
a user's job runs it: ``jobs/confirm.py``), each with its own sign-test
interval. (One model switching plans every step, as the race does, pays for
the switching itself, so it reads a plan's gain smaller than a job that
runs the plan from its first step.) The verdict is "faster" only if every launch's interval
lies below 1: an intersection-union test, whose false-"faster" rate is at
most 2.5% for any launch whose own median is not below 1 (Berger 1982), so
variation between launches cannot manufacture a verdict. The interval
reported is the hull of the launches' intervals: it contains every launch's
median with probability >= 1 - 0.05 L (Bonferroni) and is at least as
wide as the spread between launches, which is how that spread enters the
figure. The ratio reported is the median over all rounds.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass

import numpy as np

# The confirmation's two-sided level: each side's error is at most half of it.
LEVEL = 0.95
# 80% power, the usual target when sizing a test.
_POWER = 0.8
# Rounds beyond which confirmation_rounds skips ahead instead of trying every even count.
_SCAN = 200


class Verdict(enum.StrEnum):
    """What the confirmation says of a plan against FSDP2's default."""

    FASTER = "faster"  # the interval's upper end is below 1
    SLOWER = "slower"  # its lower end is above 1
    NO_SIGNIFICANT_DIFFERENCE = "no significant difference"


@dataclass(frozen=True)
class Confirmation:
    """A confirmed comparison of a plan with FSDP2's default.

    Attributes:
        ratio: median per-round ratio, plan / default, over every launch's rounds.
        ci95: ``(low, high)``: the sign-test 95% interval of that median; over several launches, the hull of
            theirs ([Note: Confirming across launches]).
        rounds: fresh rounds measured, all launches together.
        noise_pct: step-to-step interquartile range / median of the two plans' steps, %.
        verdict: :class:`Verdict` from ``ci95``.
        launches: the launches (processes) the rounds come from.
    """

    ratio: float
    ci95: tuple[float, float]
    rounds: int
    noise_pct: float
    verdict: Verdict
    launches: int = 1


def step_noise_pct(series: list[list[float]]) -> float:
    """Step-to-step noise: interquartile range / median of each series of step times, median over series, %.

    Series with fewer than 4 steps are left out; ``nan`` if none is left.
    """
    import statistics

    spreads = []
    for t in series:
        if len(t) >= 4:
            q1, _, q3 = statistics.quantiles(t, n=4)
            spreads.append(100.0 * (q3 - q1) / statistics.median(t))
    return statistics.median(spreads) if spreads else float("nan")


@functools.cache
def order_statistic(n: int, level: float = LEVEL) -> int:
    """``k``: the sign-test interval of ``n`` sorted values is ``[x_(k), x_(n+1-k)]`` (1-based), ``0`` if none reaches
    ``level`` (fewer than 6 values at 95%). [Note: The sign-test interval]."""
    from scipy.stats import binom

    # k = 1 + the largest j with P(Binomial(n, 1/2) <= j) <= alpha/2, at most n // 2: start at the quantile and
    # step to the exact edge (a few cdf calls at any n, where counting up from 0 costs n / 2 of them).
    alpha = (1.0 - level) / 2
    j = int(binom.ppf(alpha, n, 0.5))
    while j >= 0 and binom.cdf(j, n, 0.5) > alpha:
        j -= 1
    while j + 1 < n and binom.cdf(j + 1, n, 0.5) <= alpha:
        j += 1
    return max(0, min(n // 2, j + 1))


def false_faster_rate(n: int, level: float = LEVEL) -> float:
    """The exact chance of the verdict "faster" over ``n`` rounds for a plan exactly as fast as the default
    (``P(d < 0) = 1/2``, continuous ``d``): ``P(Binomial(n, 1/2) <= k - 1)``; ``0`` where no interval exists."""
    from scipy.stats import binom

    k = order_statistic(n, level)
    return float(binom.cdf(k - 1, n, 0.5)) if k else 0.0


def power(n: int, shift: float, sigma: float, level: float = LEVEL) -> float:
    """The chance that ``n`` rounds confirm a plan faster by ``shift`` (0.03 = 3%) with per-round log-ratio noise
    ``sigma`` (normal): ``P(Binomial(n, p) >= n + 1 - k)``, ``p = Phi(log1p(shift) / sigma)``."""
    from scipy.stats import binom, norm

    k = order_statistic(n, level)
    if not k:
        return 0.0
    p = float(norm.cdf(math.log1p(shift) / sigma)) if sigma > 0 else 1.0
    return float(binom.sf(n - k, n, p))


def detectable_effect(sigma: float, rounds: int) -> float:
    """The smallest speed-up (as a fraction, 0.03 = 3%) that a confirmation of ``rounds`` rounds finds "faster" with
    80% power, for per-round log ratios of standard deviation ``sigma``; ``nan`` when ``sigma`` is unknown, ``inf``
    when no interval exists at that many rounds."""
    from scipy.stats import binom, norm

    if not sigma == sigma:
        return float("nan")
    k = order_statistic(rounds)
    if not k:
        return float("inf")
    # The p = P(d < 0) at which P(Binomial(n, p) >= n + 1 - k) = 0.8, by bisection (monotone in p).
    lo, hi = 0.5, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if binom.sf(rounds - k, rounds, mid) >= _POWER else (mid, hi)
    return math.expm1(sigma * float(norm.ppf(hi)))


def confirmation_rounds(sigma: float, resolve: float = 0.03, bounds: tuple[int, int] = (8, 30)) -> int:
    """The fewest even rounds within ``bounds`` at which a confirmation finds a plan faster by ``resolve`` (0.03 =
    3%) with 80% power (:func:`power`); the largest even count within ``bounds`` if none does.

    Args:
        sigma: standard deviation of the per-round log ratios, as the race measured it (``nan``: the upper bound).
        resolve: the speed-up to resolve.
        bounds: ``(fewest, most)`` rounds; rounded to even counts inside them, at least 6.
    """
    low, high = max(6, bounds[0] + bounds[0] % 2), max(6, bounds[1] - bounds[1] % 2)
    if not sigma == sigma:
        return high
    if high - low > _SCAN:  # a wide range (the report's "about N rounds"): skip ahead by doubling, then scan
        step = 2
        while low + step <= high and power(low + step, resolve, sigma) < _POWER:
            low, step = low + step, 2 * step
        high = min(high, low + step)
    for n in range(low, high + 1, 2):
        if power(n, resolve, sigma) >= _POWER:
            return n
    return high


def verdict_of(ci95: tuple[float, float]) -> Verdict:
    """``FASTER`` when the interval's upper end is below 1, ``SLOWER`` when its lower end is above 1."""
    low, high = ci95
    if high < 1.0:
        return Verdict.FASTER
    if low > 1.0:
        return Verdict.SLOWER
    return Verdict.NO_SIGNIFICANT_DIFFERENCE


def _log_ratios(plan_ms: list[float], default_ms: list[float]) -> np.ndarray:
    k = order_statistic(len(plan_ms))
    if len(plan_ms) != len(default_ms) or not k:
        raise ValueError(f"a confirmation needs 6 or more paired rounds, found {len(plan_ms)} and {len(default_ms)}")
    return np.log(np.asarray(plan_ms, float) / np.asarray(default_ms, float))


def _interval(logs: np.ndarray) -> tuple[float, float]:
    """The sign-test 95% interval of the median of ``logs``, as ratios: ``scipy.stats.quantile_test``'s, which is
    ``[x_(k), x_(n+1-k)]`` with :func:`order_statistic`'s ``k`` ([Note: The sign-test interval])."""
    from scipy.stats import quantile_test

    ci = quantile_test(logs, q=0.0, p=0.5).confidence_interval(LEVEL)
    return math.exp(float(ci.low)), math.exp(float(ci.high))


def confirm(plan_ms: list[float], default_ms: list[float], noise_pct: float) -> Confirmation:
    """The median paired ratio ``plan_ms[r] / default_ms[r]`` with its sign-test 95% interval, and the verdict.

    Args:
        plan_ms, default_ms: step times of the same rounds of one launch, ms.
        noise_pct: the step noise to report with it, %.

    Raises:
        ValueError: fewer than 6 rounds, or lists of different lengths.
    """
    return confirm_launches([(plan_ms, default_ms)], noise_pct)


def confirm_launches(launches: list[tuple[list[float], list[float]]], noise_pct: float) -> Confirmation:
    """One confirmation from the rounds of several launches ([Note: Confirming across launches]).

    Args:
        launches: per launch, ``(plan_ms, default_ms)``: step times of its rounds, ms.
        noise_pct: the step noise to report with it, %.

    Raises:
        ValueError: no launch, or a launch with fewer than 6 rounds or lists of different lengths.
    """
    if not launches:
        raise ValueError("a confirmation needs at least one launch")
    logs = [_log_ratios(p, d) for p, d in launches]
    intervals = [_interval(x) for x in logs]
    ci95 = (min(low for low, _ in intervals), max(high for _, high in intervals))
    every = np.concatenate(logs)
    return Confirmation(math.exp(float(np.median(every))), ci95, len(every), noise_pct, verdict_of(ci95),
                        len(launches))


def confirmation_text(ratio: float, ci95: tuple[float, float] | list[float], rounds: int, launches: int = 1) -> str:
    """``ratio 0.893, 95% CI [0.861, 0.925] over 12 fresh rounds in 2 launches``."""
    low, high = ci95
    where = f" in {launches} launches" if launches > 1 else " in 1 launch"
    return f"ratio {ratio:.3f}, 95% CI [{low:.3f}, {high:.3f}] over {rounds} fresh rounds{where}"
