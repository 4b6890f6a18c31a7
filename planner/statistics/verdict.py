"""The confirmation: the race's survivor against FSDP2's default on fresh rounds, and the verdict.

The race selects; selecting on noisy medians favours the luckiest plan (the
winner's curse), so the figure the tool reports comes from rounds the
selection never saw. The survivor and the default run again, interleaved
(in each pair of rounds one order and then the other, which comes first
drawn at random), in one or more launches (processes). The figure is the
total-time ratio: what the plan's steps cost in all, over what FSDP2's
default's cost ([Note: The estimand is total time]); its interval includes
the spread between processes ([Note: Between-launch spread]); the verdict
follows from the interval.

[Note: The estimand is total time]
A user pays for the sum of the steps, not for the median one. A plan 2%
faster on most steps that stalls at 1.5x on one step in ten costs 2.9% more
in all, and a median-based test calls it faster. So per launch ``l`` with
rounds ``(p_i, d_i)`` the estimate is ``y_l = log(sum p / sum d)``, the log of
the ratio of the two plans' total times, with the within-launch variance of
the linearised estimator (delta method; Cochran, *Sampling Techniques*,
6.9): ``v_l = var(p_i / mean(p) - d_i / mean(d)) / n``. Paired rounds share
the machine's slow moments, which cancel in the difference. The median
per-round ratio is kept as a descriptive figure, labelled so.

[Note: Between-launch spread]
A process's rounds share its state (allocator, caches, where the OS put its
threads), so a plan's gain moves from process to process by more than one
process's rounds can see: ``y_l = mu + delta_l + e_l`` with ``delta_l ~ N(0,
tau^2)`` between launches and ``e_l ~ N(0, v_l)`` within. The combined
estimate weighs the launches by ``1 / (v_l + tau^2)`` (the random-effects
mean; DerSimonian & Laird 1986), its standard error is
``1 / sqrt(sum w_l)``, and the 95% interval is ``mu +- t * se`` with Student's
``t`` on the degrees of freedom ``tau`` rests on. ``tau`` comes from
:class:`Spread`: a conservative prior (``tau = 0.045`` on the log scale,
worth 8 degrees of freedom: above the 0.02-0.035 measured between fresh
processes on GPT-2 and Llama) pooled with the study's own multi-launch
evidence, each launch group adding ``L - 1`` degrees of freedom and its
moment estimate ``s^2 - mean(v)`` (a scaled-inverse-chi-square update). A
single launch can still be called faster, when its gain clears the spread.

[Note: Provisional verdicts]
When the launches' own rounds say faster (the interval with ``tau = 0``
lies below 1) but the spread is not cleared, the verdict is
``PROVISIONAL``: never "faster". The plan is applied (every plan leaves the
loss bitwise identical, so it costs nothing in correctness) and the in-loop
tuner's next start re-confirms it on a few steps, adding a launch, until
it is faster across processes or, at :data:`MAX_LAUNCHES` launches, the
default returns. The looks this makes (one per launch count, at most
:data:`MAX_LAUNCHES`) are checked together by simulation: with the prior
above and ``tau = 0.04`` their joint false-"faster" rate stays under 2.5%
(``tests/planner/statistics/test_verdict.py``).
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# The confirmation's two-sided level: each side's error is at most half of it.
LEVEL = 0.95
# 80% power, the usual target when sizing a test.
POWER = 0.8
# Rounds a launch needs for its within-launch variance (the sizing keeps confirmations at 6 or more).
MIN_ROUNDS = 4
# Launches a provisional verdict gathers before the default returns ([Note: Provisional verdicts]).
MAX_LAUNCHES = 3


class Verdict(enum.StrEnum):
    """What the confirmation says of a plan against FSDP2's default."""

    FASTER = "faster"  # the interval's upper end is below 1, the spread between processes included
    PROVISIONAL = "provisional"  # faster in the launches measured, not across processes yet
    SLOWER = "slower"  # its lower end is above 1
    NO_SIGNIFICANT_DIFFERENCE = "no significant difference"


@dataclass(frozen=True)
class LaunchEstimate:
    """One launch's total-time ratio ([Note: The estimand is total time]).

    Attributes:
        log_ratio: ``log(sum plan_ms / sum default_ms)``.
        variance: its within-launch variance (delta method).
        rounds: the paired rounds.
    """

    log_ratio: float
    variance: float
    rounds: int


def launch_estimate(plan_ms: Sequence[float], default_ms: Sequence[float]) -> LaunchEstimate:
    """The launch's log total-time ratio and its within-launch variance.

    Args:
        plan_ms, default_ms: step times of the same rounds, ms.

    Raises:
        ValueError: fewer than :data:`MIN_ROUNDS` rounds, lists of different lengths, or a time not positive.
    """
    p, d = np.asarray(plan_ms, float), np.asarray(default_ms, float)
    if len(p) != len(d) or len(p) < MIN_ROUNDS:
        raise ValueError(f"a confirmation launch needs {MIN_ROUNDS} or more paired rounds, found {len(p)} and "
                         f"{len(d)}")
    if not (np.all(p > 0) and np.all(d > 0)):
        raise ValueError("a confirmation's step times must be positive")
    u = p / p.mean() - d / d.mean()
    return LaunchEstimate(math.log(p.sum() / d.sum()), float(u.var(ddof=1)) / len(p), len(p))


@dataclass(frozen=True)
class Spread:
    """The spread of a plan's log total-time ratio between launches, ``tau``, and the degrees of freedom it rests
    on ([Note: Between-launch spread]).

    Attributes:
        tau: standard deviation between launches, log scale (0.03: about 3%).
        df: degrees of freedom: the prior's plus one less than each evidence group's launches.
    """

    tau: float
    df: float

    def updated(self, groups: Sequence[Sequence[LaunchEstimate]]) -> Spread:
        """This spread pooled with the launches of ``groups`` (each: one plan's launches against the default; groups
        of one launch carry no evidence): ``tau^2 = (df tau^2 + sum (L - 1)(s^2 - mean v)) / (df + sum (L - 1))``,
        floored at 0."""
        df, total = self.df, self.df * self.tau ** 2
        for group in groups:
            if len(group) < 2:
                continue
            y = np.array([g.log_ratio for g in group])
            total += (len(group) - 1) * (float(y.var(ddof=1)) - float(np.mean([g.variance for g in group])))
            df += len(group) - 1
        return Spread(math.sqrt(max(total, 0.0) / df), df)


# The conservative prior every study starts from ([Note: Between-launch spread]).
DEFAULT_SPREAD = Spread(0.045, 8.0)


@dataclass(frozen=True)
class Confirmation:
    """A confirmed comparison of a plan with FSDP2's default.

    Attributes:
        ratio: the total-time ratio plan / default: the launches' random-effects mean, as a ratio
            ([Note: The estimand is total time]).
        ci95: ``(low, high)``: the 95% interval of ``ratio``, the spread between launches included.
        rounds: fresh rounds measured, all launches together.
        noise_pct: step-to-step interquartile range / median of the two plans' steps, %.
        verdict: :class:`Verdict` from ``ci95`` (and ``within_ci95`` for ``PROVISIONAL``).
        launches: the launches (processes) the rounds come from.
        median_ratio: the median per-round ratio over every launch's rounds (descriptive); ``None`` on
            confirmations stored before the total-time estimand.
        tau: the between-launch spread the interval used (log scale); ``None`` on older confirmations, whose
            ``ratio`` is the median per-round ratio with a sign-test interval.
        within_ci95: the 95% interval without the spread between launches: what the launches' own rounds say.
    """

    ratio: float
    ci95: tuple[float, float]
    rounds: int
    noise_pct: float
    verdict: Verdict
    launches: int = 1
    median_ratio: float | None = None
    tau: float | None = None
    within_ci95: tuple[float, float] | None = None

    @property
    def total_time(self) -> bool:
        """Whether ``ratio`` is the total-time ratio (else an older confirmation's median per-round ratio)."""
        return self.tau is not None

    def line(self) -> str:
        """``total-time ratio 0.893, 95% CI [0.861, 0.925] over 48 fresh rounds in 2 launches: faster (median
        round 0.887)``; a provisional verdict adds what the launches' own rounds say."""
        text = f"{confirmation_text(self.ratio, self.ci95, self.rounds, self.launches, self.total_time)}: " \
               f"{self.verdict}"
        if self.verdict == Verdict.PROVISIONAL and self.within_ci95 is not None:
            text += (f" (within these launches 95% CI [{self.within_ci95[0]:.3f}, {self.within_ci95[1]:.3f}]; "
                     f"not yet across processes: the in-loop tuner's next start adds a launch, up to "
                     f"{MAX_LAUNCHES})")
        if self.median_ratio is not None:
            text += f" (median round {self.median_ratio:.3f}, descriptive)"
        return text

    def detectable(self) -> float:
        """The total-time gain (0.07 = 7%) a confirmation of as many launches and rounds calls faster with 80% power,
        at the within-launch noise and the spread this one measured (:func:`detectable_gain`); ``nan`` for an older
        confirmation, which has neither."""
        if self.tau is None or self.within_ci95 is None:
            return float("nan")
        launches, per_launch = max(1, self.launches), max(MIN_ROUNDS, self.rounds // max(1, self.launches))
        se0 = math.log(self.within_ci95[1] / self.within_ci95[0]) / (2 * _quantile(self.rounds - launches))
        sigma = se0 * math.sqrt(launches * per_launch)  # the per-round noise the within-launch interval implies
        return detectable_gain(launches, per_launch, sigma, Spread(self.tau, DEFAULT_SPREAD.df + launches - 1))


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
def _quantile(df: float) -> float:
    from scipy.stats import t

    return float(t.ppf(0.5 + LEVEL / 2, df))


def verdict_of(ci95: tuple[float, float], within_ci95: tuple[float, float] | None = None,
               launches: int = 1) -> Verdict:
    """``FASTER`` when the interval's upper end is below 1, ``SLOWER`` when its lower end is above 1; else
    ``PROVISIONAL`` when ``within_ci95`` lies below 1 and fewer than :data:`MAX_LAUNCHES` launches were measured
    ([Note: Provisional verdicts])."""
    low, high = ci95
    if high < 1.0:
        return Verdict.FASTER
    if low > 1.0:
        return Verdict.SLOWER
    if within_ci95 is not None and within_ci95[1] < 1.0 and launches < MAX_LAUNCHES:
        return Verdict.PROVISIONAL
    return Verdict.NO_SIGNIFICANT_DIFFERENCE


def _pooled(estimates: Sequence[LaunchEstimate], tau: float) -> tuple[float, float]:
    w = np.array([1.0 / (e.variance + tau ** 2) if e.variance + tau ** 2 > 0 else 1e12 for e in estimates])
    y = np.array([e.log_ratio for e in estimates])
    return float((w * y).sum() / w.sum()), float(1.0 / math.sqrt(w.sum()))


def confirm(plan_ms: list[float], default_ms: list[float], noise_pct: float,
            spread: Spread = DEFAULT_SPREAD) -> Confirmation:
    """One launch's confirmation (:func:`confirm_launches` of one launch).

    Raises:
        ValueError: fewer than :data:`MIN_ROUNDS` rounds, or lists of different lengths.
    """
    return confirm_launches([(plan_ms, default_ms)], noise_pct, spread)


def confirm_launches(launches: Sequence[tuple[Sequence[float], Sequence[float]]], noise_pct: float,
                     spread: Spread = DEFAULT_SPREAD) -> Confirmation:
    """One confirmation from the rounds of one or more launches ([Note: Between-launch spread]).

    Args:
        launches: per launch, ``(plan_ms, default_ms)``: step times of its rounds, ms.
        noise_pct: the step noise to report with it, %.
        spread: the study's between-launch spread before these launches (their own spread is added to it).

    Raises:
        ValueError: no launch, or a launch with fewer than :data:`MIN_ROUNDS` rounds or lists of different lengths.
    """
    if not launches:
        raise ValueError("a confirmation needs at least one launch")
    estimates = [launch_estimate(p, d) for p, d in launches]
    used = spread.updated([estimates])
    mu, se = _pooled(estimates, used.tau)
    q = _quantile(used.df)
    ci95 = (math.exp(mu - q * se), math.exp(mu + q * se))
    mu0, se0 = _pooled(estimates, 0.0)
    q0 = _quantile(sum(e.rounds - 1 for e in estimates))  # Student's t on the rounds' own degrees of freedom
    within = (math.exp(mu0 - q0 * se0), math.exp(mu0 + q0 * se0))
    logs = np.concatenate([np.log(np.asarray(p, float) / np.asarray(d, float)) for p, d in launches])
    return Confirmation(math.exp(mu), ci95, len(logs), noise_pct, verdict_of(ci95, within, len(estimates)),
                        len(estimates), math.exp(float(np.median(logs))), used.tau, within)


def power(launches: int, rounds: int, gain: float, sigma: float, spread: Spread = DEFAULT_SPREAD) -> float:
    """The chance that ``launches`` launches of ``rounds`` rounds call a plan faster whose total time is ``gain``
    lower (0.07 = 7%), for per-round log-ratio noise ``sigma``, between-launch spread ``spread``: the combined
    test's ``P(T_df > t - delta / se)``, ``se^2 = (sigma^2 / rounds + tau^2) / launches`` (the normal model of
    [Note: Between-launch spread], ``tau`` as the study knows it now)."""
    from scipy.stats import t

    if launches < 1 or rounds < MIN_ROUNDS or gain <= 0:
        return 0.0
    sigma = 0.0 if not sigma == sigma else sigma
    se = math.sqrt((sigma ** 2 / rounds + spread.tau ** 2) / launches)
    delta = -math.log1p(-gain)
    df = spread.df + launches - 1
    return float(t.sf(_quantile(df) - delta / se, df)) if se > 0 else 1.0


def detectable_gain(launches: int, rounds: int, sigma: float, spread: Spread = DEFAULT_SPREAD) -> float:
    """The smallest total-time gain (0.07 = 7%) that ``launches`` launches of ``rounds`` rounds call faster with 80%
    power (:func:`power`); ``nan`` when ``sigma`` is unknown."""
    if not sigma == sigma:
        return float("nan")
    lo, hi = 0.0, 0.99
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if power(launches, rounds, mid, sigma, spread) >= POWER else (mid, hi)
    return hi


def confirmation_rounds(sigma: float, resolve: float = 0.03, bounds: tuple[int, int] = (8, 30), launches: int = 1,
                        spread: Spread = DEFAULT_SPREAD) -> int:
    """The fewest even rounds per launch within ``bounds`` at which ``launches`` launches find a plan faster by
    ``resolve`` (0.03 = 3%) with 80% power (:func:`power`); else the even count within ``bounds`` past which more
    rounds add less than a point of power (the spread between launches then dominates: more launches, not more
    rounds, would resolve it).

    Args:
        sigma: standard deviation of the per-round log ratios, as the race measured it (``nan``: the upper bound).
        resolve: the speed-up to resolve.
        bounds: ``(fewest, most)`` rounds; rounded to even counts inside them, at least 6.
        launches: the launches the confirmation runs in (at least 1).
        spread: the study's between-launch spread.
    """
    low, high = max(6, bounds[0] + bounds[0] % 2), max(6, bounds[1] - bounds[1] % 2)
    if not sigma == sigma:
        return high
    launches = max(1, launches)
    ceiling = power(launches, 10 ** 6, resolve, sigma, spread)
    for n in range(low, high + 1, 2):
        p = power(launches, n, resolve, sigma, spread)
        if p >= POWER or ceiling - p < 0.01:
            return n
    return high


def confirmation_text(ratio: float, ci95: tuple[float, float] | Sequence[float], rounds: int, launches: int = 1,
                      total_time: bool = True) -> str:
    """``total-time ratio 0.893, 95% CI [0.861, 0.925] over 12 fresh rounds in 2 launches`` (older confirmations:
    ``median ratio ...``)."""
    low, high = ci95
    where = f" in {launches} launches" if launches != 1 else " in 1 launch"
    figure = "total-time ratio" if total_time else "median ratio"
    return f"{figure} {ratio:.3f}, 95% CI [{low:.3f}, {high:.3f}] over {rounds} fresh rounds{where}"
