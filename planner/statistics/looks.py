"""The looks a plan's verdict gets as launches accumulate, and the error each look may spend.

[Note: Looks spent over the restart chain]
A plan that is not yet faster across processes is looked at again as fresh
launches accumulate: ``tune``'s confirmation launches, then each start of the
in-loop tuner, then a later job that races it again, up to its chain's
horizon of fresh launches (:attr:`Looks.horizon`: :data:`MAX_LAUNCHES`
unless the confirmation's design asks for more to reach its power, at most
:data:`MOST_LAUNCHES`; fixed at the chain's first look). Each look at the nominal 2.5% would
make the chain's chance of ever calling a plan with nothing to gain "faster"
about twice that over three looks (``docs/decisions/statistics-evidence.md``). So the looks share the
2.5%: a group-sequential design (Jennison & Turnbull, *Group Sequential
Methods*, 2000, ch. 7) with the error spent as the information grows, the
information fraction of a look at ``L`` fresh launches being
``min(L / horizon, 1)`` and the spending function Hwang, Shih & DeCani's
(1990) with ``gamma = -2``: little at the first launch, most by the third.
Looks may come at any launch counts, in any order of ``tune`` and in-loop
starts (Lan & DeMets 1983): each look's boundary solves
``P(no earlier look crossed, this one does) = alpha(t_k) - alpha(t_{k-1})``
for the joint normal of the looks' statistics, whose correlations are
``sqrt(L_i / L_j)``; a look with no new fresh launch has nothing to spend.
The boundaries are z values at the floor of the spread (a stated bound,
[Note: The spread is floored at the cluster's bound] in
:mod:`planner.statistics.launches`); above it a verdict takes Student's ``t``
at the same one-sided level.

A plan already called faster is not looked at for "faster" again: a later
job's re-confirmation can only keep or revoke it, so it is tested at the
plain one-sided 2.5% (:attr:`Looks.reconfirming`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

# Fresh launches a plan not yet faster gathers before the default returns, unless its design asks for more
# ([Note: Looks spent ...]).
MAX_LAUNCHES = 3
# The most fresh launches a chain may plan for (a confirmation design that needs more resolves less).
MOST_LAUNCHES = 6
# One side of the confirmation's two-sided 95% level: the chance of a false "faster" a chain may spend.
ALPHA = 0.025
# Hwang-Shih-DeCani's gamma ([Note: Looks spent over the restart chain]).
GAMMA = -2.0


def spent(t: float, alpha: float = ALPHA, gamma: float = GAMMA) -> float:
    """The error spent by information fraction ``t`` (0..1): Hwang, Shih & DeCani's
    ``alpha (1 - exp(-gamma t)) / (1 - exp(-gamma))``."""
    t = min(max(t, 0.0), 1.0)
    return alpha * (1 - math.exp(-gamma * t)) / (1 - math.exp(-gamma))


@dataclass(frozen=True)
class Looks:
    """Where a look stands in its plan's chain of looks.

    Attributes:
        earlier: the fresh launches at each earlier look of the chain that did not call the plan faster, oldest
            first.
        reconfirming: an earlier look called it faster: this one keeps or revokes that (plain one-sided
            :data:`ALPHA`).
        seen: the fresh launches at the chain's latest look, whatever it said.
        horizon: the fresh launches the chain plans for, fixed at its first look (information fraction
            ``L / horizon``).
    """

    earlier: tuple[int, ...] = ()
    reconfirming: bool = False
    seen: int = 0
    horizon: int = MAX_LAUNCHES

    def level(self, fresh: int) -> float:
        """The one-sided level a look at ``fresh`` fresh launches tests "faster" at; 0 when it has nothing to spend
        (no fresh launch, or none since the chain's latest look: the same evidence looked at again)."""
        if fresh < 1 or fresh <= max(self.seen, self.earlier[-1] if self.earlier else 0):
            return 0.0
        if self.reconfirming:
            return ALPHA
        z = boundaries((*self.earlier, fresh), max_launches=self.horizon)[-1]
        from scipy.special import ndtr  # norm.sf(z) is ndtr(-z), without its argument checks

        return float(ndtr(-z)) if math.isfinite(z) else 0.0


@functools.cache
def boundaries(looks: tuple[int, ...], alpha: float = ALPHA, gamma: float = GAMMA,
               max_launches: int = MAX_LAUNCHES) -> tuple[float, ...]:
    """The z boundaries of looks at ``looks`` fresh launches (increasing), by the spending of :func:`spent` over
    fractions ``min(L / max_launches, 1)`` ([Note: Looks spent over the restart chain]); ``inf`` where a look has
    nothing left to spend.

    Raises:
        ValueError: launch counts that are not positive and increasing.
    """
    import numpy as np
    from scipy.optimize import brentq
    from scipy.stats import multivariate_normal, norm

    if not looks or looks[0] < 1 or any(b <= a for a, b in zip(looks, looks[1:], strict=False)):
        raise ValueError(f"looks need positive, increasing launch counts, found {looks}")
    cov = np.array([[math.sqrt(min(a, b) / max(a, b)) for b in looks] for a in looks])
    out: list[float] = []
    before = 0.0
    for k, launches in enumerate(looks):
        now = spent(launches / max_launches, alpha, gamma)
        if now - before <= 1e-12:
            out.append(math.inf)
            continue
        if k == 0:
            out.append(float(norm.isf(now)))
        else:
            joint = multivariate_normal(mean=np.zeros(k + 1), cov=cov[:k + 1, :k + 1], abseps=1e-6, releps=0,
                                        seed=0)

            def stays_below(c: float, k: int = k, joint=joint, now=now) -> float:
                return float(joint.cdf(np.array([*out[:k], c]))) - (1 - now)

            out.append(float(brentq(stays_below, 0.0, 10.0, xtol=1e-4)))
        before = now
    return tuple(out)
