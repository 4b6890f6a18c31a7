"""Calibration: fit the simulator's global parameters to measured plans.

The profile's figures are measured in isolation; in a real step there is also
per-hook CPU work, per-collective copy-in/copy-out, and (on a CPU device)
compute slowed by the collectives running beside it, and compute and
collective times that differ from their isolated measurement. Five global
parameters (:class:`planner.simulator.SimParams`) absorb these; they are
fitted to measured step times with ``scipy.optimize.least_squares`` on the
relative error, within physical bounds, and saved in the profile
(``Profile.calibration``) so every later simulation uses them. How many of
them to fit is chosen by leave-one-out cross-validation: on the CPU testbed
the full set fitted the noise and broke the ranking of held-back plans.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

import numpy as np

from planner.errors import PlannerError
from planner.plan import Plan
from planner.profile import Profile
from planner.simulator import SimParams, simulate

# Each parameter: (lower bound, upper bound, typical step for the solver). overlap_slowdown stops at 2:
# sharing a core fairly, compute beside a collective runs at half speed at worst; a larger factor would
# make overlapping slower than running one after the other.
PARAMETERS = {
    "issue_overhead_ms": (0.0, 50.0, 1.0),
    "overlap_slowdown": (1.0, 2.0, 0.5),
    "collective_latency_ms": (0.0, 200.0, 10.0),
    "comm_scale": (0.25, 3.0, 0.3),
    "compute_scale": (0.5, 3.0, 0.3),
}

# Families of parameters to fit, simplest first; :func:`fit` picks one by leave-one-out error.
FAMILIES = (
    ("compute_scale", "comm_scale"),
    ("compute_scale", "comm_scale", "overlap_slowdown"),
    tuple(PARAMETERS),
)


@dataclass(frozen=True)
class Observation:
    """A plan and its measured step time (ms, median, max across ranks)."""

    plan: Plan
    measured_ms: float


def errors_pct(profile: Profile, observations: list[Observation], params: SimParams | None = None) -> list[float]:
    """Signed prediction error per observation, ``100 * (predicted - measured) / measured``."""
    return [100.0 * (simulate(profile, o.plan, params).step_ms - o.measured_ms) / o.measured_ms
            for o in observations]


def fit_family(profile: Profile, observations: list[Observation], names: tuple[str, ...]) -> SimParams:
    """Least squares on relative error over the parameters ``names`` (the others keep their defaults)."""
    from scipy.optimize import least_squares

    lower = np.array([PARAMETERS[n][0] for n in names])
    upper = np.array([PARAMETERS[n][1] for n in names])
    step = np.array([PARAMETERS[n][2] for n in names])
    default = SimParams()
    x_default = np.clip(np.array([getattr(default, n) for n in names], float), lower, upper)

    def params_at(x: np.ndarray) -> SimParams:
        return dataclasses.replace(default, **{n: float(v) for n, v in zip(names, x)})

    def residuals(x: np.ndarray) -> np.ndarray:
        p = params_at(x)
        return np.array([simulate(profile, o.plan, p).step_ms / o.measured_ms - 1.0 for o in observations])

    # The model is piecewise linear in the parameters: start from a few points, keep the best local solution.
    best = None
    for x0 in (x_default, lower + 0.25 * (upper - lower), lower + 0.5 * (upper - lower)):
        r = least_squares(residuals, x0, bounds=(lower, upper), diff_step=1e-2, x_scale=step)
        if best is None or r.cost < best.cost:
            best = r
    return params_at(best.x)


def fit(profile: Profile, observations: list[Observation], families: tuple[tuple[str, ...], ...] = FAMILIES
        ) -> SimParams:
    """Fit :class:`SimParams` to ``observations``, choosing how many parameters by cross-validation.

    Each family of :data:`FAMILIES` with no more parameters than
    observations is scored by leave-one-out (fit on all plans but one,
    predict that one; median relative error); the best family (the smaller
    on a tie) is then fitted on every observation. Fewer than 4
    observations: the simplest family. Least squares on relative error
    (``scipy.optimize.least_squares``), within :data:`PARAMETERS` bounds.

    Raises:
        PlannerError: fewer than 2 observations.
    """
    if len(observations) < 2:
        raise PlannerError(f"calibration needs at least 2 measured plans, found {len(observations)}")
    candidates = [f for f in families if len(f) <= len(observations)] or [families[0]]
    if len(observations) < 4 or len(candidates) == 1:
        return fit_family(profile, observations, candidates[0])

    def loo_error(names: tuple[str, ...]) -> float:
        errs = []
        for i, o in enumerate(observations):
            p = fit_family(profile, observations[:i] + observations[i + 1:], names)
            errs.append(abs(simulate(profile, o.plan, p).step_ms / o.measured_ms - 1.0))
        return statistics.median(errs)

    best = min(candidates, key=lambda f: (round(loo_error(f), 4), len(f)))
    return fit_family(profile, observations, best)


def calibrated(profile: Profile, params: SimParams) -> Profile:
    """A copy of ``profile`` carrying ``params`` as its calibration."""
    return dataclasses.replace(profile, calibration=dataclasses.asdict(params))


def summary(errs: list[float]) -> str:
    """``median |err| x%, max y%`` of signed errors."""
    a = [abs(e) for e in errs]
    return f"median |error| {statistics.median(a):.1f}%, max {max(a):.1f}%"


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman rank correlation (``scipy.stats.spearmanr``: tied values share their average rank).

    ``nan`` when either sequence is constant.
    """
    from scipy.stats import spearmanr

    if len(set(a)) < 2 or len(set(b)) < 2:
        return float("nan")
    return float(spearmanr(a, b).statistic)
