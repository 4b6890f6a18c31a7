"""The confirmation: the race's survivor against FSDP2's default on fresh rounds, and the verdict.

The race selects; selecting on noisy medians favours the luckiest plan (the
winner's curse), so the figure the tool reports comes from rounds the
selection never saw. The survivor and the default run again, interleaved
(in each pair of rounds one order and then the other, which comes first
drawn at random), in one or more launches (processes). The figure is the
total-time ratio ([Note: The estimand is total time] in
:mod:`planner.statistics.launches`); its interval includes the spread between
processes, never below the cluster's floor ([Note: The spread is floored at the
cluster's bound]), at the level the plan's chain of looks leaves it ([Note: Looks spent
over the restart chain] in :mod:`planner.statistics.looks`); the verdict
follows from the interval.

[Note: The race's own process]
The in-loop tuner races and confirms in one process, and so does ``tune``
without fresh launches. The survivor won its race partly on that process's
offset ``delta_l``, which its confirmation rounds share (by a few percent
with a handful of candidates that have nothing to gain: figures in
``docs/decisions/statistics-evidence.md``). So a launch whose race picked the survivor among two candidates or
more (:attr:`ConfirmLaunch.picked`) never shows a plan faster, and adds
nothing to the spread: "faster" rests on the fresh launches, those the race
did not pick from. A race of one candidate (a recheck of the study's
recommendation) picks nothing; it only drops a plan significantly slower.

[Note: Provisional verdicts]
When the launches' own rounds say faster (the interval without the spread,
over every launch, lies below 1) but the fresh launches do not clear the
spread, the verdict is ``PROVISIONAL``: measured, not applied. The study
keeps recommending FSDP2's default, and the plan races again at the in-loop
tuner's next start and in a later ``tune`` job, each adding a fresh launch,
until it is faster across processes or, at its chain's horizon of fresh
launches (:attr:`Looks.horizon`), the chain ends. Within the one process
that measured it, the in-loop tuner may still run it
([Note: Applied in the process that measured it] in
:mod:`planner.statistics.watch`): that estimand is this process's. Applying it would have had no bound on how
often a slower plan runs (``docs/decisions/statistics-evidence.md``). Only "faster" is applied, so
what runs is wrong at most 2.5% of the time, over every look.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from planner.statistics.launches import (
    DEFAULT_SPREAD,
    MIN_ROUNDS,
    ConfirmLaunch,
    Spread,
    UsedSpread,
    launch_estimate,
    plan_spread,
    pooled,
)
from planner.statistics.looks import ALPHA, MAX_LAUNCHES, Looks

# The confirmation's two-sided level: each side's error is at most half of it, over every look.
LEVEL = 1 - 2 * ALPHA
# 80% power, the usual target when sizing a test.
POWER = 0.8


class Verdict(enum.StrEnum):
    """What the confirmation says of a plan against FSDP2's default."""

    FASTER = "faster"  # the interval's upper end is below 1, the spread between processes included: applied
    PROVISIONAL = "provisional"  # faster in the launches measured, not across processes yet: not applied
    SLOWER = "slower"  # its lower end is above 1
    NO_SIGNIFICANT_DIFFERENCE = "no significant difference"


@dataclass(frozen=True)
class Confirmation:
    """A confirmed comparison of a plan with FSDP2's default.

    Attributes:
        ratio: the total-time ratio plan / default over the fresh launches (every launch when none is fresh), as a
            ratio ([Note: The estimand is total time]).
        ci95: ``(low, high)``: its interval, the spread between launches included, at the level the plan's chain
            of looks leaves ([Note: Looks spent over the restart chain]): 95% over every look together.
        rounds: fresh rounds measured, all launches together.
        noise_pct: step-to-step interquartile range / median of the two plans' steps, %.
        verdict: :class:`Verdict` from ``ci95`` (and ``within_ci95`` for ``PROVISIONAL``).
        launches: the launches (processes) the rounds come from.
        median_ratio: the median per-round ratio over every launch's rounds (descriptive); ``None`` on
            confirmations stored before the total-time estimand.
        tau: the between-launch spread the interval used (log scale); ``None`` on older confirmations, whose
            ``ratio`` is the median per-round ratio with a sign-test interval.
        within_ci95: the 95% interval over every launch without the spread between launches: what the launches' own
            rounds say.
        fresh: the launches the verdict rests on, those no race picked the plan in ([Note: The race's own
            process]); ``None`` on confirmations stored before it was kept (every launch counted).
        df: the degrees of freedom of the spread's estimate; ``None`` when the spread is the floor (a stated
            bound) or on older confirmations.
        level: the one-sided level this look tested "faster" at (0: it could not); ``None`` on older
            confirmations.
        floor: the floor of the spread the verdict used: the cluster's calibrated bound, else its device's prior
            (log scale); ``None`` on confirmations stored before floors were per cluster (the CPU prior's 0.045).
        horizon: the fresh launches its chain plans for (:attr:`Looks.horizon`); ``None`` on older
            confirmations (:data:`MAX_LAUNCHES`).
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
    fresh: int | None = None
    df: float | None = None
    level: float | None = None
    floor: float | None = None
    horizon: int | None = None

    @property
    def total_time(self) -> bool:
        """Whether ``ratio`` is the total-time ratio (else an older confirmation's median per-round ratio)."""
        return self.tau is not None

    @property
    def fresh_launches(self) -> int:
        """The launches the verdict rests on (every launch on confirmations that predate ``fresh``)."""
        return self.launches if self.fresh is None else self.fresh

    def line(self) -> str:
        """``total-time ratio 0.893, 95% CI [0.861, 0.925] over 48 fresh rounds in 2 launches: faster (median
        round 0.887)``; a provisional verdict adds what the launches' own rounds say."""
        text = f"{confirmation_text(self.ratio, self.ci95, self.rounds, self.launches, self.total_time)}"
        if self.fresh == 0:
            text += " (the race's own process, which cannot show it faster)"
        elif self.fresh is not None and self.fresh < self.launches:
            text += f" ({self.launches - self.fresh} of them the race's own process, which cannot show it faster)"
        text += f": {self.verdict}"
        if self.verdict == Verdict.PROVISIONAL and self.within_ci95 is not None:
            text += (f" (within these launches 95% CI [{self.within_ci95[0]:.3f}, {self.within_ci95[1]:.3f}]; "
                     f"not applied until it is faster across processes: each in-loop start or tune job adds a "
                     f"fresh launch, up to {self.horizon or MAX_LAUNCHES})")
        if self.median_ratio is not None:
            text += f" (median round {self.median_ratio:.3f}, descriptive)"
        return text

    def noise_sigma(self) -> float:
        """The per-round noise (standard deviation of a round's log ratio) the within-launch interval implies;
        ``nan`` for an older confirmation, which has none."""
        if self.within_ci95 is None:
            return float("nan")
        launches = max(1, self.launches)
        per_launch = max(MIN_ROUNDS, self.rounds // launches)
        se0 = math.log(self.within_ci95[1] / self.within_ci95[0]) / (2 * _t_quantile(self.rounds - launches))
        return se0 * math.sqrt(launches * per_launch)

    def detectable(self) -> float:
        """The total-time gain (0.07 = 7%) a confirmation of as many fresh launches and rounds calls faster with 80%
        power, at the within-launch noise (:meth:`noise_sigma`) and the spread this one used
        (:func:`detectable_gain`, through :func:`power` as the design's); ``nan`` for an older confirmation, which
        has neither."""
        if self.tau is None or self.within_ci95 is None:
            return float("nan")
        launches, fresh = max(1, self.launches), max(1, self.fresh_launches)
        per_launch = max(MIN_ROUNDS, self.rounds // launches)
        sigma = self.noise_sigma()
        floor = DEFAULT_SPREAD.tau if self.floor is None else self.floor
        # the study's spread before this confirmation's own launches, which power() adds back
        spread = Spread(self.tau, max(0.0, self.df - (fresh - 1))) if self.df is not None else Spread(floor, 0.0)
        return detectable_gain(fresh, per_launch, sigma, spread, floor, Looks(horizon=self.horizon or MAX_LAUNCHES))


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


def _t_quantile(df: float) -> float:
    """Student's ``t`` at the two-sided 95% level."""
    from scipy.stats import t

    return float(t.isf(ALPHA, df))


def quantile(level: float, used: UsedSpread) -> float:
    """The one-sided quantile at ``level`` for a spread ``used``: normal at the floor, Student's ``t`` on the
    estimate's degrees of freedom above it ([Note: The spread is floored at the cluster's bound]); ``inf`` at
    level 0."""
    if level <= 0:
        return math.inf
    return _one_sided(level, used.df)


@functools.lru_cache(maxsize=4096)
def _one_sided(level: float, df: float | None) -> float:
    """``norm.isf(level)`` (``df`` ``None``) or ``t.isf(level, df)``: the few levels a chain's looks leave and the
    few degrees of freedom its spreads have recur in every sizing (:func:`power` is called thousands of times)."""
    from scipy.stats import norm, t

    return float(norm.isf(level) if df is None else t.isf(level, df))


@functools.lru_cache(maxsize=64)
def _chi2_midpoints(df: int) -> np.ndarray:
    """``chi2.ppf`` at the 400 quantile midpoints ``(i + 0.5) / 400`` for ``df`` degrees of freedom (:func:`power`'s
    quadrature nodes; read-only)."""
    from scipy.stats import chi2

    nodes = chi2.ppf((np.arange(400) + 0.5) / 400, df)
    nodes.setflags(write=False)
    return nodes


def verdict_of(ci95: tuple[float, float], within_ci95: tuple[float, float] | None = None,
               fresh: int = 1, horizon: int = MAX_LAUNCHES) -> Verdict:
    """``FASTER`` when the interval's upper end is below 1, ``SLOWER`` when its lower end is above 1; else
    ``PROVISIONAL`` when ``within_ci95`` lies below 1 and fewer than ``horizon`` fresh launches (the chain's,
    :attr:`Looks.horizon`) were measured ([Note: Provisional verdicts])."""
    low, high = ci95
    if high < 1.0:
        return Verdict.FASTER
    if low > 1.0:
        return Verdict.SLOWER
    if within_ci95 is not None and within_ci95[1] < 1.0 and fresh < horizon:
        return Verdict.PROVISIONAL
    return Verdict.NO_SIGNIFICANT_DIFFERENCE


@dataclass(frozen=True)
class Chain:
    """What a plan brings to its confirmation from earlier processes: the launches of the trials it re-confirms
    (oldest first) and the looks they were given.

    Attributes:
        launches: the earlier launches' rounds.
        looks: the earlier looks ([Note: Looks spent over the restart chain]).
    """

    launches: tuple[ConfirmLaunch, ...] = ()
    looks: Looks = field(default_factory=Looks)


def confirm(plan_ms: list[float], default_ms: list[float], noise_pct: float,
            spread: Spread = DEFAULT_SPREAD, floor: Spread = DEFAULT_SPREAD) -> Confirmation:
    """One fresh launch's confirmation, the first look of its chain (:func:`confirm_launches`).

    Raises:
        ValueError: fewer than :data:`MIN_ROUNDS` rounds, or lists of different lengths.
    """
    return confirm_launches([ConfirmLaunch(list(plan_ms), list(default_ms))], noise_pct, spread, floor=floor)


def confirm_launches(launches: Sequence[ConfirmLaunch], noise_pct: float, spread: Spread = DEFAULT_SPREAD,
                     looks: Looks | None = None, floor: Spread = DEFAULT_SPREAD) -> Confirmation:
    """One confirmation from the rounds of one or more launches.

    The figure and the verdict rest on the fresh launches ([Note: The race's own process]), weighed by their
    rounds ([Note: Launches weigh by their rounds]), at the spread :func:`plan_spread` allows and the level
    ``looks`` leaves ([Note: Looks spent over the restart chain]). Without a fresh launch the figure is every
    launch's and the verdict is at most ``PROVISIONAL``.

    Args:
        launches: the launches' rounds, oldest first.
        noise_pct: the step noise to report with it, %.
        spread: the study's between-launch spread before these launches (the cluster's calibration or its
            device's prior, pooled with other plans' launches): it can only raise the spread used.
        looks: the plan's earlier looks (their horizon included).
        floor: the least spread the verdict may use: the cluster's calibration (``planner.study.cluster_spread``),
            else its device's prior (:func:`~planner.statistics.launches.prior_for`); only its ``tau`` is used.

    Raises:
        ValueError: no launch, or a launch with fewer than :data:`MIN_ROUNDS` rounds or lists of different lengths.
    """
    if not launches:
        raise ValueError("a confirmation needs at least one launch")
    every = [launch_estimate(x.plan_ms, x.default_ms) for x in launches]
    fresh = [e for e, x in zip(every, launches, strict=True) if not x.picked]
    looks = looks or Looks()
    used = plan_spread(spread, fresh, floor.tau)
    mu, se = pooled(fresh or every, used.tau)
    level = looks.level(len(fresh))
    q = quantile(level if level > 0 else ALPHA, used)  # a look with nothing to spend shows the plain 95% interval
    ci95 = (math.exp(mu - q * se), math.exp(mu + q * se))
    mu0, se0 = pooled(every, 0.0)
    q0 = _t_quantile(sum(e.rounds - 1 for e in every))  # Student's t on the rounds' own degrees of freedom
    within = (math.exp(mu0 - q0 * se0), math.exp(mu0 + q0 * se0))
    verdict = verdict_of(ci95 if level > 0 else (ci95[0], max(ci95[1], 1.0)), within, len(fresh), looks.horizon)
    logs = np.concatenate([np.log(np.asarray(x.plan_ms, float) / np.asarray(x.default_ms, float)) for x in launches])
    return Confirmation(ratio=math.exp(mu), ci95=ci95, rounds=len(logs), noise_pct=noise_pct, verdict=verdict,
                        launches=len(every), median_ratio=math.exp(float(np.median(logs))), tau=used.tau,
                        within_ci95=within, fresh=len(fresh), df=used.df, level=level, floor=floor.tau,
                        horizon=looks.horizon)


def power(launches: int, rounds: int, gain: float, sigma: float, spread: Spread = DEFAULT_SPREAD,
          looks: Looks | None = None, tau: float | None = None, floor: float = DEFAULT_SPREAD.tau) -> float:
    """The chance that a look at ``launches`` fresh launches of ``rounds`` rounds calls faster a plan whose total
    time is ``gain`` lower (0.07 = 7%), for per-round log-ratio noise ``sigma``, the study's spread ``spread``
    before these launches and a true between-launch spread ``tau`` (default: ``spread.tau``).

    Exact under the normal model of [Note: Between-launch spread], computed as the verdict decides: the
    launches' mean ``mu ~ N(-delta, se^2)``, ``se^2 = (sigma^2 / rounds + tau^2) / launches``, is independent of
    their sample variance ``s^2 ~ (sigma^2 / rounds + tau^2) chi2(launches - 1) / (launches - 1)``, which sets
    the spread the verdict uses (the study's pooled with it, never below ``floor``: [Note: The spread is floored at
    the cluster's bound]) and so its quantile (normal at the floor, Student's ``t`` above it) at the level ``looks``
    leaves. So ``power = E[Phi((delta - q(s^2) se_used(s^2)) / se)]`` over ``s^2``, by quadrature on its quantiles.
    Where the spread is estimated from the launches alone (``spread.df = 0``, no floor, no within noise) this is the
    noncentral ``t``'s ``nct.sf(t_q, launches - 1, delta / se)`` (the tests check it against ``scipy.stats.nct``).
    """
    from scipy.special import ndtr  # norm.cdf's own kernel, without its argument checks (called per quadrature)

    if launches < 1 or rounds < MIN_ROUNDS or gain <= 0:
        return 0.0
    level = (looks or Looks()).level(launches)
    if level <= 0:
        return 0.0
    sigma = 0.0 if not sigma == sigma else sigma
    true_tau = spread.tau if tau is None else tau
    delta, v = -math.log1p(-gain), sigma ** 2 / rounds
    se = math.sqrt((v + true_tau ** 2) / launches)
    own = launches - 1
    if own > 0:  # the sample variance of the launches' log ratios, at quantile midpoints
        s2 = (v + true_tau ** 2) * _chi2_midpoints(own) / own
        df = spread.df + own
        tau2 = (spread.df * spread.tau ** 2 + own * (s2 - v)) / df
    else:
        df, tau2 = spread.df, np.array([spread.tau ** 2])
    estimate = np.sqrt(np.maximum(tau2, 0.0))
    at_floor = estimate <= floor
    tau_used = np.where(at_floor, floor, estimate)
    q = np.where(at_floor, quantile(level, UsedSpread(floor, None)),
                 quantile(level, UsedSpread(1.0, df)) if df > 0 else math.inf)
    se_used = np.sqrt((v + tau_used ** 2) / launches)
    if se == 0:
        return float(np.mean(delta > q * se_used))
    return float(np.mean(ndtr((delta - q * se_used) / se)))


def detectable_gain(launches: int, rounds: int, sigma: float, spread: Spread = DEFAULT_SPREAD,
                    floor: float = DEFAULT_SPREAD.tau, looks: Looks | None = None) -> float:
    """The smallest total-time gain (0.07 = 7%) that a look at ``launches`` fresh launches of ``rounds`` rounds
    (a first look unless ``looks`` says otherwise) calls faster with 80% power (:func:`power`); ``nan`` when
    ``sigma`` is unknown."""
    if not sigma == sigma:
        return float("nan")
    lo, hi = 0.0, 0.99
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if power(launches, rounds, mid, sigma, spread, looks, floor=floor) >= POWER else (mid, hi)
    return hi


def confirmation_rounds(sigma: float, resolve: float = 0.03, bounds: tuple[int, int] = (8, 30), launches: int = 1,
                        spread: Spread = DEFAULT_SPREAD, floor: float = DEFAULT_SPREAD.tau,
                        looks: Looks | None = None, tau: float | None = None) -> int:
    """The fewest even rounds per launch within ``bounds`` at which a first look at ``launches`` fresh launches
    finds a plan faster by ``resolve`` (0.03 = 3%) with 80% power (:func:`power`); else the even count within
    ``bounds`` past which more rounds add less than a point of power (the spread between launches then dominates:
    more launches, not more rounds, would resolve it).

    Args:
        sigma: standard deviation of the per-round log ratios, as the race measured it (``nan``: the upper bound).
        resolve: the speed-up to resolve.
        bounds: ``(fewest, most)`` rounds; rounded to even counts inside them, at least 6.
        launches: the launches the confirmation runs in (at least 1).
        spread: the study's between-launch spread before the confirmation.
        floor: the cluster's floor of the spread ([Note: The spread is floored at the cluster's bound]).
        looks: the look the launches end at (default: a first look, its chain's horizon :data:`MAX_LAUNCHES`).
        tau: the true spread between launches the sizing assumes (default: ``spread.tau``).
    """
    low, high = max(6, bounds[0] + bounds[0] % 2), max(6, bounds[1] - bounds[1] % 2)
    if not sigma == sigma:
        return high
    launches = max(1, launches)
    ceiling = power(launches, 10 ** 6, resolve, sigma, spread, looks, tau, floor)
    for n in range(low, high + 1, 2):
        p = power(launches, n, resolve, sigma, spread, looks, tau, floor)
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
