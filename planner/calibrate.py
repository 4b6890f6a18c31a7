"""Calibration: fit the simulator's global parameters to measured plans.

The profile's figures are measured in isolation; in a real step there is also
per-hook CPU work, per-collective copy-in/copy-out, and (on a CPU device)
compute slowed by the collectives running beside it, and collective times
that differ from their isolated measurement. Four global
parameters (:class:`planner.simulator.SimParams`) absorb these; they are
fitted to measured step times with ``scipy.optimize.least_squares`` on the
relative error, within physical bounds, and saved in the profile
(``Profile.calibration``) so every later simulation uses them.
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

# (lower, upper) bounds: issue overhead ms per hook, overlap slowdown factor,
# latency ms per collective, scale of the measured collective times.
BOUNDS = ((0.0, 1.0, 0.0, 0.25), (50.0, 4.0, 200.0, 3.0))


@dataclass(frozen=True)
class Observation:
    """A plan and its measured step time (ms, median, max across ranks)."""

    plan: Plan
    measured_ms: float


def errors_pct(profile: Profile, observations: list[Observation], params: SimParams | None = None) -> list[float]:
    """Signed prediction error per observation, ``100 * (predicted - measured) / measured``."""
    return [100.0 * (simulate(profile, o.plan, params).step_ms - o.measured_ms) / o.measured_ms
            for o in observations]


def fit(profile: Profile, observations: list[Observation]) -> SimParams:
    """Fit :class:`SimParams` to ``observations`` (least squares on relative error).

    Raises:
        PlannerError: fewer than 2 observations.
    """
    if len(observations) < 2:
        raise PlannerError(f"calibration needs at least 2 measured plans, found {len(observations)}")
    from scipy.optimize import least_squares

    def residuals(x: np.ndarray) -> np.ndarray:
        params = SimParams(issue_overhead_ms=x[0], overlap_slowdown=x[1], collective_latency_ms=x[2], comm_scale=x[3])
        return np.array([simulate(profile, o.plan, params).step_ms / o.measured_ms - 1.0 for o in observations])

    # The model is piecewise linear in the parameters: start from a few points
    # and keep the best local solution.
    best = None
    for x0 in ((0.0, 1.0, 0.0, 1.0), (1.0, 1.5, 5.0, 0.8), (5.0, 2.0, 20.0, 1.2)):
        r = least_squares(residuals, np.array(x0), bounds=BOUNDS, diff_step=1e-2, x_scale=(1.0, 0.5, 10.0, 0.3))
        if best is None or r.cost < best.cost:
            best = r
    x = best.x
    return SimParams(issue_overhead_ms=float(x[0]), overlap_slowdown=float(x[1]), collective_latency_ms=float(x[2]),
                     comm_scale=float(x[3]))


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
