"""The confirmation: the race's survivor against FSDP2's default on fresh rounds, and the verdict.

The race selects; selecting on noisy medians favours the luckiest plan (the
winner's curse), so the figure the tool reports comes from rounds the
selection never saw. The survivor and the default run again, interleaved
(order alternating), for :func:`confirmation_rounds` rounds; the reported
figure is the median of the per-round ratios survivor/default with a paired
95% bootstrap confidence interval (``scipy.stats.bootstrap``, percentile),
and the verdict follows from the interval alone.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np

# z-scores of a two-sided 95% interval and of 80% power.
_Z_CI = 1.959964
_Z_POWER = 0.841621
# Variance of a sample median over that of the mean, for normal noise (pi / 2).
_MEDIAN_EFFICIENCY = math.pi / 2


class Verdict(enum.StrEnum):
    """What the confirmation says of a plan against FSDP2's default."""

    FASTER = "faster"  # the interval's upper end is below 1
    SLOWER = "slower"  # its lower end is above 1
    NO_SIGNIFICANT_DIFFERENCE = "no significant difference"


@dataclass(frozen=True)
class Confirmation:
    """A confirmed comparison of a plan with FSDP2's default.

    Attributes:
        ratio: median per-round ratio, plan / default.
        ci95: ``(low, high)``, paired 95% bootstrap interval of that median.
        rounds: fresh rounds measured.
        noise_pct: step-to-step interquartile range / median of the two plans' steps, %.
        verdict: :class:`Verdict` from ``ci95``.
    """

    ratio: float
    ci95: tuple[float, float]
    rounds: int
    noise_pct: float
    verdict: Verdict


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


def detectable_effect(sigma: float, rounds: int) -> float:
    """The smallest slowdown or speed-up (as a fraction, 0.03 = 3%) that ``rounds`` paired rounds resolve.

    At 95% confidence and 80% power, for per-round log ratios of standard
    deviation ``sigma``, estimated by their median.
    """
    if rounds < 1 or not sigma == sigma:
        return float("nan")
    return math.expm1((_Z_CI + _Z_POWER) * sigma * math.sqrt(_MEDIAN_EFFICIENCY / rounds))


def confirmation_rounds(sigma: float, resolve: float = 0.03, bounds: tuple[int, int] = (8, 30)) -> int:
    """Rounds needed for the confirmation to resolve a difference of ``resolve`` (0.03 = 3%), within ``bounds``.

    Args:
        sigma: standard deviation of the per-round log ratios, as the race
            measured it (``nan``: the upper bound).
        resolve: the difference to resolve at 95% confidence and 80% power.
        bounds: ``(fewest, most)`` rounds.
    """
    low, high = bounds
    if not sigma == sigma:
        return high
    n = math.ceil((_Z_CI + _Z_POWER) ** 2 * _MEDIAN_EFFICIENCY * sigma ** 2 / math.log1p(resolve) ** 2)
    return max(low, min(high, n))


def verdict_of(ci95: tuple[float, float]) -> Verdict:
    """``FASTER`` when the interval's upper end is below 1, ``SLOWER`` when its lower end is above 1."""
    low, high = ci95
    if high < 1.0:
        return Verdict.FASTER
    if low > 1.0:
        return Verdict.SLOWER
    return Verdict.NO_SIGNIFICANT_DIFFERENCE


def confirm(plan_ms: list[float], default_ms: list[float], noise_pct: float, seed: int = 0) -> Confirmation:
    """The median paired ratio ``plan_ms[r] / default_ms[r]`` with its 95% bootstrap interval, and the verdict.

    Args:
        plan_ms, default_ms: step times of the same rounds, ms.
        noise_pct: the step noise to report with it, %.
        seed: the bootstrap's seed (the same measurement gives the same interval).

    Raises:
        ValueError: fewer than 2 rounds, or lists of different lengths.
    """
    from scipy.stats import bootstrap

    if len(plan_ms) != len(default_ms) or len(plan_ms) < 2:
        raise ValueError(f"a confirmation needs 2 or more paired rounds, found {len(plan_ms)} and {len(default_ms)}")
    logs = np.log(np.asarray(plan_ms, float) / np.asarray(default_ms, float))
    if np.ptp(logs) == 0.0:
        low = high = float(logs[0])
    else:
        result = bootstrap((logs,), np.median, confidence_level=0.95, n_resamples=4999, method="percentile",
                           rng=np.random.default_rng(seed))
        low, high = float(result.confidence_interval.low), float(result.confidence_interval.high)
    ci95 = (math.exp(low), math.exp(high))
    return Confirmation(math.exp(float(np.median(logs))), ci95, len(logs), noise_pct, verdict_of(ci95))


def confirmation_text(ratio: float, ci95: tuple[float, float] | list[float], rounds: int) -> str:
    """``ratio 0.893, 95% CI [0.861, 0.925] over 12 fresh rounds``."""
    low, high = ci95
    return f"ratio {ratio:.3f}, 95% CI [{low:.3f}, {high:.3f}] over {rounds} fresh rounds"
