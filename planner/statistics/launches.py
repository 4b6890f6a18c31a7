"""A confirmation's launches: each process's paired rounds, its total-time ratio, and the spread between processes.

[Note: The estimand is total time]
A user pays for the sum of the steps, not for the median one. A plan 2%
faster on most steps that stalls at 1.5x on one step in ten costs 2.9% more
in all, and a median-based test calls it faster. So per launch ``l`` with
rounds ``(p_i, d_i)`` the estimate is ``y_l = log(sum p / sum d)``, the log of
the ratio of the two plans' total times, with the within-launch variance of
the linearised estimator (delta method; Cochran, *Sampling Techniques*,
6.9): ``s_l^2 / n_l``, ``s_l^2 = var(p_i / mean(p) - d_i / mean(d))``. Paired
rounds share the machine's slow moments, which cancel in the difference.

[Note: Between-launch spread]
A process's rounds share its state (allocator, caches, where the OS put its
threads), so a plan's gain moves from process to process by more than one
process's rounds can see: ``y_l = mu + delta_l + e_l`` with ``delta_l ~ N(0,
tau^2)`` between launches and ``e_l`` within. :class:`Spread` holds what is
known of ``tau``: the cluster's calibration or its device's prior
(:data:`PRIORS`), pooled with launch groups (each group adds ``L - 1``
degrees of freedom and its moment estimate ``s^2 - mean(v)``, a
scaled-inverse-chi-square update).

[Note: The spread is floored at the cluster's bound]
A plan's own spread between launches is not another plan's: a study whose
plans' launches agreed drives the pooled ``tau`` down, and one launch of a
plan whose own spread is larger carries no evidence of it. So evidence only
raises the spread a verdict uses (:func:`plan_spread`): a floor that no
study and no launch group lowers, and above it the pooled estimate, with its
degrees of freedom. The floor belongs to the cluster: its calibration
(:func:`calibrate`, [Note: A cluster's calibration]) where one was run, else
the prior of its device kind (:data:`PRIORS`). At the floor ``tau`` is a
stated bound, not an estimate, and the interval uses normal quantiles; above
it, Student's ``t`` on the estimate's degrees of freedom. Figures:
``docs/decisions/cluster-spread.md``.

[Note: A cluster's calibration]
Unselected plans measured in fresh launches (FSDP2's default against a
second copy of itself, and plans of the search space that no race picked)
show the cluster's spread between launches with nothing chosen on it. Each
pair's launches are a group; ``(L - 1) s^2 / (tau^2 + v) ~ chi2(L - 1)``
per group (``v`` the launches' within variance), pooled over the groups.
The calibration is the one-sided upper bound at
:data:`CALIBRATION_CONFIDENCE`, ``tau_U^2 = sum (L - 1) s^2 /
chi2_{1-c}(df) - v``: a bound, so a verdict may use it as a known spread.
It is both the floor of every verdict on that cluster and the evidence a
new study starts from.

[Note: Launches weigh by their rounds]
The launches' mean weighs each by its rounds, not by ``1 / (v_l + tau^2)``
(the random-effects weights of DerSimonian & Laird 1986). With stalls a launch
that happened to see none has both a lower ratio and a far smaller ``v_l``,
so inverse-variance weights hand the pooled mean to the luckiest launch, and a
slower plan is called faster (``docs/decisions/statistics-evidence.md``). Each
launch's ``v_l`` is the pooled within-launch
variance over every launch's rounds, divided by its own rounds: a launch
that saw no stall borrows the variance of one that did. The standard error
is ``sqrt(sum w_l^2 (v_l + tau^2))``, ``w_l = n_l / sum n``.

Within one launch the delta-method interval cannot cover what its rounds did
not see: with a stall on one step in ten, 53% of 6-round launches have none,
and no resampling of those rounds widens an interval for it. That is why the
interval without the spread (``within``) decides nothing a user runs: it
only marks a plan provisional ([Note: Provisional verdicts] in
:mod:`planner.statistics.verdict`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Rounds a launch needs for its within-launch variance (the sizing keeps confirmations at 6 or more).
MIN_ROUNDS = 4


@dataclass(frozen=True)
class ConfirmLaunch:
    """One launch's confirmation rounds: the survivor's and FSDP2's default's step times, ms (max across ranks), in
    the same rounds.

    Attributes:
        plan_ms, default_ms: step times of the same rounds, ms.
        picked: the launch is the process whose race picked the survivor among two candidates or more: its
            offset is part of why the survivor won, so it cannot show the plan faster
            ([Note: The race's own process] in :mod:`planner.statistics.verdict`).
    """

    plan_ms: list[float]
    default_ms: list[float]
    picked: bool = False

    def to_json(self) -> dict[str, list[float] | bool]:
        """The launch as a JSON value."""
        out: dict[str, list[float] | bool] = {"plan_ms": list(self.plan_ms), "default_ms": list(self.default_ms)}
        if self.picked:
            out["picked"] = True
        return out

    @classmethod
    def from_json(cls, value: dict) -> ConfirmLaunch:
        """The launch :meth:`to_json` wrote (launches stored before ``picked`` read as not picked)."""
        return cls(list(value["plan_ms"]), list(value["default_ms"]), bool(value.get("picked", False)))


@dataclass(frozen=True)
class LaunchEstimate:
    """One launch's total-time ratio ([Note: The estimand is total time]).

    Attributes:
        log_ratio: ``log(sum plan_ms / sum default_ms)``.
        variance: its within-launch variance (delta method), from the launch's own rounds.
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
        floored at 0. An estimate: a verdict uses :func:`plan_spread`, which never goes below the cluster's floor."""
        df, total = self.df, self.df * self.tau ** 2
        for group in groups:
            if len(group) < 2:
                continue
            y = np.array([g.log_ratio for g in group])
            total += (len(group) - 1) * (float(y.var(ddof=1)) - float(np.mean([g.variance for g in group])))
            df += len(group) - 1
        return Spread(math.sqrt(max(total, 0.0) / df), df)


@dataclass(frozen=True)
class Prior:
    """A device kind's prior spread between launches, before its cluster is calibrated.

    Attributes:
        spread: the prior ``tau`` and the degrees of freedom it is worth.
        source: where the figure comes from.
        measured: whether it was measured on such a cluster (else it is read from published repeats).
    """

    spread: Spread
    source: str
    measured: bool


# The priors per device kind ([Note: The spread is floored at the cluster's bound]): the floor of every verdict on a
# cluster with no calibration of its own, and the evidence its studies start from.
PRIORS: dict[str, Prior] = {
    "cpu": Prior(Spread(0.045, 8.0), "0.02-0.035 between fresh processes of 2 gloo ranks on GPT-2 and Llama, "
                 "floored above them (docs/decisions/cluster-spread.md)", True),
    "cuda": Prior(Spread(0.02, 4.0), "not a measurement: 0.1-0.7% between repeated launches of one configuration "
                  "(torchtitan #4620, #4670; pytorch #5799), 1-2% across days and nodes (the Llama 3 report), its "
                  "upper end taken (docs/decisions/cluster-spread.md)", False),
}
# The CPU's prior, the most conservative: every device kind without a prior of its own takes it.
DEFAULT_SPREAD = PRIORS["cpu"].spread
# The one-sided confidence of a calibration's upper bound ([Note: A cluster's calibration]).
CALIBRATION_CONFIDENCE = 0.9
# Degrees of freedom a calibration needs before it stands: fewer, and the device's prior stays the floor.
MIN_CALIBRATION_DF = 4


def prior_for(device_type: str) -> Prior:
    """The prior of ``device_type`` (``"cpu"``, ``"cuda"``); any other device takes the CPU's, the largest."""
    return PRIORS.get(device_type, PRIORS["cpu"])


def calibrate(groups: Sequence[Sequence[LaunchEstimate]], confidence: float = CALIBRATION_CONFIDENCE) -> Spread:
    """The cluster's spread between launches from unselected pairs of plans, each measured in fresh launches
    ([Note: A cluster's calibration]): the one-sided upper bound on ``tau`` at ``confidence``, with the degrees of
    freedom it rests on.

    Args:
        groups: per pair of plans (FSDP2's default against a copy of itself, or against a plan no race picked), its
            launches' estimates (:func:`launch_estimate`); a group of one launch carries no evidence.
        confidence: the bound's one-sided confidence (0.9: ``tau`` exceeds it one calibration in ten).

    Returns:
        ``Spread(tau_U, df)``, ``df = sum (L - 1)`` over the groups.

    Raises:
        ValueError: fewer than :data:`MIN_CALIBRATION_DF` degrees of freedom, or ``confidence`` outside (0, 1).
    """
    from scipy.stats import chi2

    if not 0.0 < confidence < 1.0:
        raise ValueError(f"a calibration's confidence must lie in (0, 1), found {confidence}")
    kept = [g for g in groups if len(g) >= 2]
    df = sum(len(g) - 1 for g in kept)
    if df < MIN_CALIBRATION_DF:
        raise ValueError(f"a calibration needs {MIN_CALIBRATION_DF} or more degrees of freedom (one less than each "
                         f"pair's launches, summed), found {df}")
    squares = sum((len(g) - 1) * float(np.var([e.log_ratio for e in g], ddof=1)) for g in kept)
    within = sum((len(g) - 1) * float(np.mean([e.variance for e in g])) for g in kept) / df
    bound = squares / float(chi2.ppf(1.0 - confidence, df)) - within
    return Spread(math.sqrt(max(bound, 0.0)), float(df))


@dataclass(frozen=True)
class UsedSpread:
    """The spread a verdict uses ([Note: The spread is floored at the cluster's bound]).

    Attributes:
        tau: ``max(floor, estimate)``, log scale.
        df: the estimate's degrees of freedom; ``None`` at the floor, a stated bound (normal quantiles).
    """

    tau: float
    df: float | None


def plan_spread(study: Spread, own: Sequence[LaunchEstimate], floor: float = DEFAULT_SPREAD.tau) -> UsedSpread:
    """The spread a verdict on a plan uses: the study's spread (``study``: the cluster's calibration or its
    device's prior, pooled with other plans' launches) pooled with the plan's own launches, never below ``floor``
    (the cluster's calibrated bound, else its device's prior ``tau``)."""
    estimate = study.updated([own])
    if estimate.tau <= floor:
        return UsedSpread(floor, None)
    return UsedSpread(estimate.tau, estimate.df)


def pooled(estimates: Sequence[LaunchEstimate], tau: float) -> tuple[float, float]:
    """The launches' mean log ratio and its standard error at spread ``tau`` ([Note: Launches weigh by their
    rounds]): weights ``n_l / sum n``, each ``v_l`` the pooled within-launch variance over ``n_l``.

    Raises:
        ValueError: no launch.
    """
    if not estimates:
        raise ValueError("a pooled ratio needs at least one launch")
    n = np.array([e.rounds for e in estimates], float)
    y = np.array([e.log_ratio for e in estimates])
    s2 = float(sum((e.rounds - 1) * e.variance * e.rounds for e in estimates) / (n - 1).sum())
    w = n / n.sum()
    return float((w * y).sum()), float(math.sqrt((w ** 2 * (s2 / n + tau ** 2)).sum()))
