"""Calibration: fit the simulator's global parameters to measured plans, and keep the fit only when it is physical.

The profile's figures are measured in isolation; in a real step there is also
per-hook CPU work, per-collective copy-in/copy-out, and (on a CPU device)
compute slowed by the collectives running beside it, and compute and
collective times that differ from their isolated measurement. Five global
parameters (:class:`planner.simulation.simulator.SimParams`) absorb these.

[Note: A calibration must earn its place]
A fit with about as many parameters as points fits the noise (a few measured
plans the model ties can push a parameter onto its bound), and later runs of
the study would reuse it. So :func:`calibrate`
- fits a family of parameters only with at least ``2k + 2`` observations for
  ``k`` parameters (leave-one-out then still fits on more than ``2k`` points);
- regularizes toward the uncalibrated values: each parameter has a Gaussian
  prior (:data:`PARAMETERS`), weighted as one observation's noise
  (:data:`OBSERVATION_NOISE`), beside the relative errors in
  ``scipy.optimize.least_squares``;
- picks the family by leave-one-out error, then rejects the fit if a
  parameter lands on a guard bound other than its uncalibrated value, or if
  its error does not beat the uncalibrated model's by more than the
  measurement's own noise at that number of plans: ``sqrt(pi/2) e / sqrt(n)``
  points, ``e`` the relative standard error of one measured median (%), the
  standard error of a median over ``n`` plans of errors that noise alone
  would make ([Note: Guard bounds and physical limits]);
- quotes nested cross-validation error: each plan is predicted by a fit on
  the others whose family was itself chosen by leave-one-out among those
  others, so choosing the best of three families does not flatter the
  figure (Varma & Simon 2006). With one family allowed, that is plain
  leave-one-out.
A rejected fit is never saved; the result says why.

[Note: Guard bounds and physical limits]
Some bounds only guard the fit (``comm_scale`` 0.25 and 3, ``compute_scale``
0.5 and 3, 50 ms of per-hook overhead, 200 ms of latency): a fit there says
the data wants a value no mechanism gives, and is rejected. Others are what
the parameter means (:data:`PHYSICAL_LIMITS`): no per-hook overhead, no
latency, an overlap that costs nothing (``overlap_slowdown`` 1) or one core
shared fairly (2). A fit there says the effect is absent, or as large as it
can be, and is judged like any other fit: by its cross-validated error
against the noise floor: a fit that finds an overlap costing nothing
(``overlap_slowdown`` 1) where the microbenchmark read more is an answer
about the step, not a fit that failed.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

import numpy as np

from planner.artifacts.plan import Plan
from planner.artifacts.profile import Profile
from planner.errors import PlannerError
from planner.simulation.in_step import in_step_params
from planner.simulation.parameters import simulator_for
from planner.simulation.simulator import CompiledPlan, SimParams, Simulator

# Each parameter: (lower bound, upper bound, prior standard deviation around its uncalibrated value).
# overlap_slowdown stops at 2: sharing a core fairly, compute beside a collective runs at half speed at worst.
PARAMETERS = {
    "issue_overhead_ms": (0.0, 50.0, 2.0),
    "overlap_slowdown": (1.0, 2.0, 0.5),
    "collective_latency_ms": (0.0, 200.0, 20.0),
    "comm_scale": (0.25, 3.0, 0.5),
    "compute_scale": (0.5, 3.0, 0.3),
}
# The bounds that are physical limits rather than guards ([Note: Guard bounds and physical limits]).
PHYSICAL_LIMITS = {
    "issue_overhead_ms": (0.0,),
    "overlap_slowdown": (1.0, 2.0),
    "collective_latency_ms": (0.0,),
}
# Relative error of one measured median (step noise over several steps): the weight of one prior, and the
# measurement's noise when the caller does not know it.
OBSERVATION_NOISE = 0.03
# Observations needed per fitted parameter, beyond 2: n >= 2k + 2.
OBSERVATIONS_PER_PARAMETER = 2

# Families of parameters to fit, simplest first; :func:`calibrate` picks one by leave-one-out error.
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


@dataclass(frozen=True)
class CalibrationResult:
    """What :func:`calibrate` concluded.

    Attributes:
        params: the fitted parameters when accepted, else ``None`` (keep the
            uncalibrated model).
        family: the parameters fitted (``None`` if no family was allowed).
        loo_error_pct: median |relative error| by nested cross-validation: each plan predicted by a fit on the
            others, its family chosen on those others by leave-one-out, %.
        uncalibrated_error_pct: median |relative error| of the uncalibrated model, %.
        reason: one line: why it was accepted or rejected.
    """

    params: SimParams | None
    family: tuple[str, ...] | None
    loo_error_pct: float | None
    uncalibrated_error_pct: float
    reason: str

    @property
    def accepted(self) -> bool:
        """Whether the fit may be used and saved."""
        return self.params is not None

    def apply(self, profile: Profile) -> Profile:
        """``profile`` carrying the calibration if accepted, else ``profile`` without any."""
        if self.params is None:
            return dataclasses.replace(profile, calibration=None)
        return calibrated(profile, self.params)


def errors_pct(profile: Profile, observations: list[Observation], params: SimParams | None = None) -> list[float]:
    """Signed prediction error per observation, ``100 * (predicted - measured) / measured``.

    ``params``: default the profile's own (its calibration, else its in-step parameters).
    """
    simulator = simulator_for(profile, params)
    return [100.0 * (simulator.run(o.plan).step_ms - o.measured_ms) / o.measured_ms for o in observations]


def min_observations(family: tuple[str, ...]) -> int:
    """Observations needed to fit ``family``: ``2k + 2`` ([Note: A calibration must earn its place])."""
    return OBSERVATIONS_PER_PARAMETER * len(family) + 2


class _Problem:
    """The observations as one uncalibrated simulator reads them: plans compiled once, fitted many times."""

    def __init__(self, profile: Profile, observations: list[Observation], base: SimParams):
        self.base = base
        self.simulator = Simulator(profile, base)
        self.plans: list[CompiledPlan] = [self.simulator.compile(o.plan) for o in observations]
        self.measured = [o.measured_ms for o in observations]
        # (family, observations) -> the fit: the nested cross-validation fits each set with two observations left
        # out twice (i then j, j then i), on the same observations in the same order
        self._fits: dict[tuple[tuple[str, ...], tuple[int, ...]], SimParams] = {}

    def relative_errors(self, params: SimParams, which: list[int]) -> list[float]:
        """``predicted / measured - 1`` of the observations ``which`` under ``params``."""
        return [self.simulator.run(self.plans[i], params).step_ms / self.measured[i] - 1.0 for i in which]

    def fit(self, names: tuple[str, ...], which: list[int]) -> SimParams:
        """Regularized least squares over the parameters ``names`` on the observations ``which`` (each set fitted
        once)."""
        key = (names, tuple(which))
        if key not in self._fits:
            self._fits[key] = self._fit(names, which)
        return self._fits[key]

    def _fit(self, names: tuple[str, ...], which: list[int]) -> SimParams:
        from scipy.optimize import least_squares

        lower = np.array([PARAMETERS[n][0] for n in names])
        upper = np.array([PARAMETERS[n][1] for n in names])
        prior_sd = np.array([PARAMETERS[n][2] for n in names])
        x0 = np.array([getattr(self.base, n) for n in names], float)

        def params_at(x: np.ndarray) -> SimParams:
            return dataclasses.replace(self.base, **{n: float(v) for n, v in zip(names, x, strict=True)})

        def residuals(x: np.ndarray) -> np.ndarray:
            return np.concatenate([self.relative_errors(params_at(x), which), OBSERVATION_NOISE * (x - x0) / prior_sd])

        # The model is piecewise linear in the parameters: start from a few points, keep the best local solution.
        best = None
        for start in (x0, lower + 0.25 * (upper - lower), lower + 0.5 * (upper - lower)):
            r = least_squares(residuals, np.clip(start, lower, upper), bounds=(lower, upper), diff_step=1e-2,
                              x_scale=prior_sd)
            if best is None or r.cost < best.cost:
                best = r
        return params_at(best.x)

    def loo_error_pct(self, family: tuple[str, ...], which: list[int] | None = None) -> float:
        """Median |error| of each observation of ``which`` (default: all) predicted by a fit of ``family`` on the
        others of ``which``, %."""
        which = list(range(len(self.plans))) if which is None else which
        errs = []
        for k, i in enumerate(which):
            p = self.fit(family, which[:k] + which[k + 1:])
            errs.append(100.0 * self.relative_errors(p, [i])[0])
        return _median_abs_pct(errs)

    def choose(self, families: list[tuple[str, ...]], which: list[int]) -> tuple[float, tuple[str, ...]]:
        """The family of ``families`` (those ``which`` has enough observations for) with the lowest leave-one-out
        error on ``which``, ties to the smaller; ``(error %, family)``."""
        allowed = [f for f in families if len(which) >= min_observations(f)] or families[:1]
        scored = [(round(self.loo_error_pct(f, which), 4), len(f), f) for f in allowed]
        loo, _, family = min(scored)
        return loo, family

    def nested_error_pct(self, families: list[tuple[str, ...]]) -> float:
        """Median |error| of each observation predicted by the family :meth:`choose` picks on the others, fitted
        on the others, % ([Note: A calibration must earn its place])."""
        everyone = list(range(len(self.plans)))
        if len(families) == 1:
            return self.loo_error_pct(families[0])
        errs = []
        for i in everyone:
            others = everyone[:i] + everyone[i + 1:]
            _, family = self.choose(families, others)
            errs.append(100.0 * self.relative_errors(self.fit(family, others), [i])[0])
        return _median_abs_pct(errs)


def fit_family(profile: Profile, observations: list[Observation], names: tuple[str, ...]) -> SimParams:
    """Regularized least squares on relative error over the parameters ``names``.

    The others keep, and the priors are centred on, the uncalibrated values
    (:func:`planner.simulation.in_step.in_step_params`).
    """
    problem = _Problem(profile, observations, in_step_params(profile))
    return problem.fit(names, list(range(len(observations))))


def _median_abs_pct(errors: list[float]) -> float:
    return statistics.median(abs(e) for e in errors)


def _on_a_bound(params: SimParams, family: tuple[str, ...], default: SimParams) -> str | None:
    """The first parameter of ``family`` within 1% of a guard bound that is not its uncalibrated value
    (``default``); bounds in :data:`PHYSICAL_LIMITS` are not guards ([Note: Guard bounds and physical limits])."""
    for name in family:
        low, high, _ = PARAMETERS[name]
        value, tolerance = getattr(params, name), 0.01 * (high - low)
        for bound in (low, high):
            if bound in PHYSICAL_LIMITS.get(name, ()):
                continue
            if abs(value - bound) <= tolerance and bound != getattr(default, name):
                return f"{name} {value:.3g} is on its bound {bound:g}"
    return None


def noise_floor_pct(measurement_error_pct: float, plans: int) -> float:
    """The gain (percentage points of median |error|) that noise alone makes likely over ``plans`` plans, each
    measured with relative standard error ``measurement_error_pct``: ``sqrt(pi / 2) e / sqrt(n)``."""
    return math.sqrt(math.pi / 2) * measurement_error_pct / math.sqrt(max(1, plans))


def calibrate(profile: Profile, observations: list[Observation], families: tuple[tuple[str, ...], ...] = FAMILIES,
              measurement_error_pct: float | None = None) -> CalibrationResult:
    """Fit :class:`SimParams` to ``observations`` and decide whether the fit is worth keeping.

    Args:
        profile: the profile (its own calibration is ignored: fits start from the uncalibrated model,
            :func:`planner.simulation.in_step.in_step_params`).
        observations: measured plans.
        families: the parameter families to try, simplest first.
        measurement_error_pct: relative standard error of one plan's measured median, % (default
            :data:`OBSERVATION_NOISE`).

    Returns:
        A :class:`CalibrationResult`, accepted or rejected with the reason
        ([Note: A calibration must earn its place]).
    """
    base = in_step_params(profile)
    problem = _Problem(profile, observations, base)
    everyone = list(range(len(observations)))
    uncalibrated = (_median_abs_pct([100.0 * e for e in problem.relative_errors(base, everyone)])
                    if observations else float("nan"))
    allowed = [f for f in families if len(observations) >= min_observations(f)]
    if not allowed:
        return CalibrationResult(
            None, None, None, uncalibrated,
            f"not fitted: {len(observations)} measured plans, a fit needs at least "
            f"{min_observations(families[0])} (twice its {len(families[0])} parameters, plus 2)")
    _, family = problem.choose(allowed, everyone)
    params = problem.fit(family, everyone)
    on_bound = _on_a_bound(params, family, base)
    nested = problem.nested_error_pct(allowed)
    if on_bound:
        return CalibrationResult(None, family, nested, uncalibrated, f"rejected: {on_bound}")
    error = 100 * OBSERVATION_NOISE if measurement_error_pct is None else measurement_error_pct
    floor = noise_floor_pct(error, len(observations))
    if not uncalibrated - nested > floor:
        return CalibrationResult(None, family, nested, uncalibrated,
                                 f"rejected: cross-validated error {nested:.1f}% does not beat the in-step "
                                 f"parameters' {uncalibrated:.1f}% by more than the measurement noise at "
                                 f"{len(observations)} plans ({floor:.1f} points)")
    return CalibrationResult(params, family, nested, uncalibrated,
                             f"accepted: cross-validated error {nested:.1f}%, in-step parameters "
                             f"{uncalibrated:.1f}%, a gain above the measurement noise at {len(observations)} plans "
                             f"({floor:.1f} points)")


def fit(profile: Profile, observations: list[Observation]) -> SimParams:
    """The parameters :func:`calibrate` accepts, else the uncalibrated ones.

    Raises:
        PlannerError: fewer than 2 observations.
    """
    if len(observations) < 2:
        raise PlannerError(f"calibration needs at least 2 measured plans, found {len(observations)}")
    return calibrate(profile, observations).params or in_step_params(profile)


def calibrated(profile: Profile, params: SimParams) -> Profile:
    """A copy of ``profile`` carrying ``params`` as its calibration."""
    return dataclasses.replace(profile, calibration=dataclasses.asdict(params))


def summary(errs: list[float]) -> str:
    """``median |error| x%, max y%`` of signed errors."""
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
