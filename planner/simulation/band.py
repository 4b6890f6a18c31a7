"""The band on a predicted step: how far the step predicted for a target may be off, and what it rests on.

[Note: The band on a predicted step]
A step predicted for another cluster (``simulate --target``) rests on three
figures the profile cannot pin down, each moved to its stated bound and the
plan simulated again:
- the fit: each kind's per-call overhead and time per byte moved by its
  leave-one-out error ([Note: The fit's own error] in
  :mod:`planner.simulation.link`), all calls of a kind together (an error
  shared by every call, the conservative reading);
- the links: every link's bandwidth at the ends of its stated ``spread`` (a
  preset's published range; 0 for a figure given without one);
- rank skew: a step ends when its slowest rank does, and more ranks draw a
  slower slowest. The recorded ranks' compute per step (``Profile.per_rank``)
  gives its spread across ranks ``sigma``; the expected largest of ``N``
  normal draws is ``sigma`` times Blom's score ``Phi^-1((N - 0.375) / (N +
  0.25))``, so going from the recorded ``n`` ranks to the target's ``N`` adds
  ``compute * sigma * (score(N) - score(n))``. One recorded rank: unknown, 0;
- the level: the profile's figures and the step they are checked against come
  from different processes, and a process runs at its own level (a CPU's
  speed from one stretch to the next, a GPU node's clocks). The step moves
  by the device's prior spread between launches
  (``planner.statistics.launches.prior_for``, the floor a verdict uses), both
  ways. Fresh profiles of one loop move the prediction by about as much
  (``python -m bench.layout_sweep --profiles 3`` reports the spread).
The parts are taken as independent and added in quadrature on each side. The
band is what the prediction rests on, not a confidence interval of the
machine: a host slower or faster than the profile's, or a cost the simulator
does not model, lies outside it; its coverage is measured
(``docs/accuracy.md``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from planner.artifacts.plan import Plan
from planner.artifacts.profile import Profile
from planner.artifacts.target import Target
from planner.simulation.simulator import SimParams
from planner.statistics.launches import prior_for
from planner.units import count


@dataclass(frozen=True)
class BandPart:
    """One figure the prediction rests on, at its bounds.

    Attributes:
        name: ``"fit"``, ``"link"``, ``"rank skew"`` or ``"level"``.
        low_ms, high_ms: how far below and above the predicted step it moves it, ms (both >= 0).
        detail: what was moved, in words.
    """

    name: str
    low_ms: float
    high_ms: float
    detail: str

    @property
    def width_ms(self) -> float:
        """``low_ms + high_ms``."""
        return self.low_ms + self.high_ms


@dataclass(frozen=True)
class Band:
    """A predicted step with its band ([Note: The band on a predicted step]).

    Attributes:
        step_ms: the predicted step, ms.
        low_ms, high_ms: the band's ends, ms.
        parts: what it rests on, each at its bounds.
    """

    step_ms: float
    low_ms: float
    high_ms: float
    parts: tuple[BandPart, ...]

    @property
    def dominant(self) -> BandPart:
        """The part that moves the step the most."""
        return max(self.parts, key=lambda p: p.width_ms)

    def contains(self, ms: float) -> bool:
        """Whether a measured step lies in the band."""
        return self.low_ms <= ms <= self.high_ms

    def describe(self) -> str:
        """``3582 ms [3203, 4102]: the fit dominates (-310/+390 ms: ...); link -80/+95 ms; rank skew +12 ms``."""
        first = self.dominant
        rest = [p for p in self.parts if p is not first]
        text = (f"{self.step_ms:.1f} ms [{self.low_ms:.1f}, {self.high_ms:.1f}]: {first.name} dominates "
                f"(-{first.low_ms:.1f}/+{first.high_ms:.1f} ms: {first.detail})")
        return text + "".join(f"; {p.name} -{p.low_ms:.1f}/+{p.high_ms:.1f} ms" for p in rest)


def blom_score(n: int) -> float:
    """The expected largest of ``n`` standard normal draws (Blom's approximation); 0 for one draw."""
    if n <= 1:
        return 0.0
    return statistics.NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def compute_spread(profile: Profile) -> float | None:
    """The recorded ranks' compute per step (forward and backward of every module, as each rank timed it): their
    standard deviation over their mean, a fraction; ``None`` with fewer than 2 ranks recorded."""
    totals = []
    for rank in profile.per_rank:
        if rank.isolated is None:
            continue
        total = sum((m.compute.fwd_ms + m.compute.bwd_ms) * rank.isolated.calls.get(fqn, 1)
                    for fqn, m in rank.isolated.modules.items() if m.compute is not None)
        if total > 0:
            totals.append(total)
    if len(totals) < 2:
        return None
    return statistics.stdev(totals) / statistics.fmean(totals)


def step_band(profile: Profile, target: Target, plan: Plan | None = None, params: SimParams | None = None,
              recorded_profile: Profile | None = None) -> Band:
    """The predicted step of ``plan`` (default: FSDP2's) on ``target`` with its band
    ([Note: The band on a predicted step]).

    Args:
        profile: the recorded profile (its own parameters predict; ``planner.simulation.parameters``).
        target: the cluster.
        plan: the plan; ``None``: FSDP2's default.
        params: the simulator's parameters; ``None``: ``profile_params(profile)`` (a profile extended to its full
            depth passes the slice's own: ``planner.simulation.depth``).
        recorded_profile: the profile as recorded, when ``profile`` was extended from it: the fit is its.

    Raises:
        TargetError: as :func:`planner.simulation.link.retarget`.
    """
    from planner.simulation.link import retarget
    from planner.simulation.parameters import profile_params, simulator_for

    plan = plan or Plan.default(profile)
    params = params if params is not None else profile_params(profile)

    def step(**signs: int) -> float:
        return simulator_for(retarget(profile, target, recorded_profile=recorded_profile, **signs).profile,
                             params).run(plan).step_ms

    as_stated = retarget(profile, target, recorded_profile=recorded_profile)
    base = simulator_for(as_stated.profile, params).run(plan).step_ms
    parts = []
    fits = as_stated.fits
    errors = ", ".join(f"{k.replace('_', '-')} {f.loo_error:.0%}" for k, f in fits.items() if f.loo_error is not None)
    lo, hi = step(fit_sign=-1), step(fit_sign=+1)
    parts.append(BandPart("fit", max(0.0, base - min(lo, hi)), max(0.0, max(lo, hi) - base),
                          f"leave-one-out error {errors}" if errors else
                          "unknown: fewer than 3 collectives recorded"))
    lo, hi = step(spread_sign=+1), step(spread_sign=-1)  # a faster link, a shorter step
    spreads = ", ".join(f"{g.role} group's link ±{g.link.spread}" for g in target.groups
                        if g.link is not None and g.size > 1)
    parts.append(BandPart("link", max(0.0, base - min(lo, hi)), max(0.0, max(lo, hi) - base),
                          f"bandwidth at its stated spread ({spreads or 'no link crossed'})"))
    sigma = compute_spread(profile)
    recorded = profile.fingerprint.world_size
    if sigma is None:
        parts.append(BandPart("rank skew", 0.0, 0.0, f"unknown: {recorded} rank recorded"))
    else:
        compute = sum((m.fwd_ms + m.bwd_ms + m.recompute_ms) * m.calls for m in profile.modules.values())
        shift = compute * sigma * (blom_score(target.world_size) - blom_score(recorded))
        parts.append(BandPart("rank skew", max(0.0, -shift), max(0.0, shift),
                              f"compute spread {sigma:.1%} across the {recorded} recorded ranks, {recorded} -> "
                              f"{count(target.world_size, 'rank')}"))
    device = profile.fingerprint.device_type
    prior = prior_for(device)
    parts.append(BandPart("level", base * prior.spread.tau, base * prior.spread.tau,
                          f"a process's own level ±{prior.spread.tau:.1%}, the {device} prior between launches"))
    low = math.sqrt(sum(p.low_ms ** 2 for p in parts))
    high = math.sqrt(sum(p.high_ms ** 2 for p in parts))
    return Band(base, base - low, base + high, tuple(parts))
