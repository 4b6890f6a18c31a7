"""The race: FSDP2's default and a few candidate plans, measured in interleaved rounds, the slow ones dropped.

Each round runs one step of every plan still in the race, in an order from a
balanced Latin square (Williams design): over a cycle of rounds every plan
follows every other one equally often, so no plan always inherits the same
predecessor's caches and allocator state. After each block of rounds the
race compares the plans by paired per-round log ratios (rounds are where the
machine's slow and fast moments are shared) and drops every candidate
significantly slower than the leader.

[Note: Dropping controls the family-wise error]
A candidate is dropped when a one-sided sign test on its per-round log
ratios to the leader's (``scipy.stats.binomtest`` on the rounds it ran
slower, H1: slower in more than half the rounds) rejects. The sign test
makes no assumption on the shape of the ratios: a few skewed rounds (one
stall in a pair) cannot drop a plan, as they could a t-test at 4 rounds,
and its error is exact at every round count. The error controlled is
dropping a true best (a plan no other is faster than): each true best is
kept with chance at least ``1 - alpha``. Two corrections give that:
- the leader is chosen by the data (the luckiest plan so far), so each
  p-value is multiplied by the number of plans the candidate could have been
  compared with (a union bound over the leaders: a true best is dropped only
  if its test against some leader rejects, and each of those tests rejects
  with chance at most its level, since a true best is not slower than any);
- ``alpha`` is spent over the looks in proportion to the rounds each adds
  (linear alpha spending, Lan & DeMets 1983, with Bonferroni across looks):
  a look after round ``r`` that follows one after round ``r0`` may spend
  ``alpha (r - r0) / max_rounds``, so the looks together spend at most ``alpha``.
No step-down across the candidates tested at one look (Holm's): the union
bound above is already about one true best, and dropping a plan that is not
one costs nothing, so Holm's divisor only cost power
(``docs/decisions/statistics-evidence.md``). With several plans tied
best each is kept with chance ``1 - alpha`` and the default, never dropped,
keeps the baseline. ``tests/planner/statistics/test_race.py`` pins the rates
on synthetic races.

[Note: Looks on whole cycles]
Rounds are run in whole cycles of the Williams design over the plans alive
(``m`` rounds for ``m`` plans if ``m`` is even, ``2m`` if odd), and the race
looks only at the end of a cycle: each plan then has followed every other
equally often, so a carry-over (the step after plan A runs slower) weighs
on every comparison alike. A drop restarts the design over the plans left,
again in whole cycles. Without this, a carry-over makes a race drop equal plans
more often than ``alpha`` (``docs/decisions/statistics-evidence.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from planner.errors import PlannerError
from planner.statistics.verdict import step_noise_pct


@dataclass(frozen=True)
class RaceSettings:
    """When the race looks, drops and stops.

    Attributes:
        alpha: the chance of ever dropping the true best ([Note: Dropping
            controls the family-wise error]).
        min_rounds: rounds before the first look, rounded up to whole cycles
            ([Note: Looks on whole cycles]).
        block_rounds: rounds between looks, rounded up to whole cycles.
        max_rounds: no block starts that would end after this many rounds (the first block always runs).
        time_budget_s: the race stops once it has run this long (s), at the end
            of a block; ``None``: no limit.
    """

    alpha: float = 0.05
    min_rounds: int = 4
    block_rounds: int = 2
    max_rounds: int = 12
    time_budget_s: float | None = None


def cycle_rounds(plans: int) -> int:
    """Rounds of one whole cycle of the Williams design over ``plans`` plans: ``plans`` if even, ``2 plans`` if odd
    (1 for a lone plan)."""
    return len(balanced_orders(plans))


def balanced_orders(n: int) -> list[list[int]]:
    """A Williams design for ``n`` items: rows of ``range(n)`` in which every item follows every other equally often.

    ``n`` rows for even ``n``, ``2n`` (each row and its reverse) for odd ``n``.
    """
    if n <= 2:
        return [list(range(n)), list(range(n))[::-1]] if n == 2 else [list(range(n))]
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(x + r) % n for x in first] for r in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


@dataclass
class Race:
    """A race of ``n_plans`` plans; plan ``default`` (FSDP2's default) is the baseline and is never dropped.

    Ask it :meth:`orders` for the next :meth:`block` of rounds, feed it with
    :meth:`record` (one round's step times, ms), and :meth:`look` at the end
    of each block, until it is :meth:`finished`.
    """

    n_plans: int
    settings: RaceSettings = field(default_factory=RaceSettings)
    default: int = 0
    rounds: list[dict[int, float]] = field(default_factory=list)
    alive: list[int] = field(init=False)
    dropped: dict[int, int] = field(default_factory=dict)  # plan -> rounds run when dropped
    looks: list[int] = field(default_factory=list)  # rounds run at each look
    _design_start: int = 0
    _comparison_level: float = float("nan")  # the last look's per-comparison level (its alpha over the union factor)

    def __post_init__(self) -> None:
        if self.n_plans < 1 or not 0 <= self.default < self.n_plans:
            raise PlannerError(f"a race needs FSDP2's default among its plans, found {self.n_plans} plans")
        self.alive = list(range(self.n_plans))
        # The rounds alpha is spent over ([Note: Dropping ...]): fixed before any data, the first block included.
        self._spend_over = max(self.settings.max_rounds, self.block())

    def block(self, looked: bool | None = None) -> int:
        """Rounds of the next block: whole cycles of the design over the plans alive, at least ``min_rounds``
        before the first look and ``block_rounds`` after ([Note: Looks on whole cycles]); ``looked``: as if a look
        had (not) been made yet (default: whether one was)."""
        cycle = cycle_rounds(len(self.alive))
        looked = bool(self.looks) if looked is None else looked
        want = self.settings.block_rounds if looked else self.settings.min_rounds
        return cycle * max(1, math.ceil(want / cycle))

    def rounds_left(self) -> int:
        """Rounds the race may still run if no plan is dropped (progress bars): the next block, which always runs,
        then, with two candidates or more, every block that would end by ``max_rounds`` (:meth:`finished`); the time
        budget is not counted."""
        left = self.block()
        after = self.block(looked=True)
        while len(self.candidates) > 1 and len(self.rounds) + left + after <= self.settings.max_rounds:
            left += after
        return left

    @property
    def candidates(self) -> list[int]:
        """The plans still racing other than the default."""
        return [p for p in self.alive if p != self.default]

    def orders(self, rounds: int) -> list[list[int]]:
        """The plans of the next ``rounds`` rounds, each in its place in the balanced design over the plans alive."""
        rows = balanced_orders(len(self.alive))
        start = len(self.rounds) - self._design_start
        return [[self.alive[i] for i in rows[(start + k) % len(rows)]] for k in range(rounds)]

    def record(self, step_ms: dict[int, float]) -> None:
        """One round: plan -> its step time, ms (max across ranks)."""
        self.rounds.append(dict(step_ms))

    def log_ratios(self, plan: int, to: int) -> np.ndarray:
        """Per-round ``log(step(plan) / step(to))`` over the rounds that ran both."""
        return np.array([math.log(r[plan] / r[to]) for r in self.rounds if plan in r and to in r])

    def leader(self) -> int:
        """The plan alive with the lowest median log ratio to the default (the default itself scores 0)."""
        def score(p: int) -> float:
            return 0.0 if p == self.default else float(np.median(self.log_ratios(p, self.default)))

        return min(self.alive, key=lambda p: (score(p), p))

    def look_alpha(self) -> float:
        """The alpha a look now may spend: ``alpha`` times the rounds since the last look over the rounds alpha is
        spent over ([Note: Dropping controls the family-wise error])."""
        since = len(self.rounds) - (self.looks[-1] if self.looks else 0)
        return self.settings.alpha * since / self._spend_over

    def look(self) -> list[int]:
        """Drop the candidates significantly slower than the leader; returns them ([Note: Dropping controls ...])."""
        from scipy.stats import binomtest

        alpha = self.look_alpha()
        self.looks.append(len(self.rounds))
        leader = self.leader()
        others = len(self.alive) - 1
        p_values = {}
        for c in self.candidates:
            if c == leader:
                continue
            d = self.log_ratios(c, leader)
            d = d[d != 0.0]
            if len(d) < 2:
                continue
            p = float(binomtest(int((d > 0).sum()), len(d), 0.5, alternative="greater").pvalue)
            p_values[c] = min(1.0, p * others)
        self._comparison_level = alpha / max(1, others)
        out = sorted(c for c, p in p_values.items() if p <= alpha)
        for c in out:
            self.alive.remove(c)
            self.dropped[c] = len(self.rounds)
        if out:
            self._design_start = len(self.rounds)
        return out

    def finished(self, elapsed_s: float = 0.0) -> bool:
        """After a look: one candidate or none left, the next block would end after ``max_rounds``, or the time
        budget spent."""
        s = self.settings
        if not self.looks or self.looks[-1] != len(self.rounds):
            return False
        return (len(self.candidates) <= 1 or len(self.rounds) + self.block() > s.max_rounds
                or (s.time_budget_s is not None and elapsed_s >= s.time_budget_s))

    def detectable_slowdown(self) -> float:
        """The slowdown against the leader (0.03 = 3%) that the last look's test rejects with 80% power: the race's
        sign test at the level each comparison had (the look's alpha over the union factor), on the rounds run,
        for normal per-round log ratios of the pooled noise :meth:`ratio_sigma`; ``nan`` before a look or without
        a noise estimate, ``inf`` when no count of slower rounds reaches that level."""
        from scipy.stats import binom, norm

        n, sigma = len(self.rounds), self.ratio_sigma()
        if not self.looks or n < 2 or not sigma == sigma:
            return float("nan")
        # The fewest slower rounds the test rejects on, then the chance per round that gives 80% power.
        need = next((k for k in range(n + 1) if binom.sf(k - 1, n, 0.5) <= self._comparison_level), None)
        if need is None:
            return float("inf")
        lo, hi = 0.5, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if binom.sf(need - 1, n, mid) >= 0.8 else (mid, hi)
        return math.expm1(sigma * float(norm.ppf(hi)))

    def survivor(self) -> int | None:
        """The candidate alive with the lowest median log ratio to the default; ``None`` if every one was dropped."""
        candidates = self.candidates
        if not candidates:
            return None
        return min(candidates, key=lambda p: (float(np.median(self.log_ratios(p, self.default))), p))

    def step_ms(self, plan: int) -> list[float]:
        """Every step time of ``plan`` in the race, ms."""
        return [r[plan] for r in self.rounds if plan in r]

    def noise_pct(self) -> float:
        """Step-to-step noise of the race, %: ``verdict.step_noise_pct`` over every plan's steps."""
        return step_noise_pct([self.step_ms(p) for p in range(self.n_plans)])

    def median_error_pct(self) -> float | None:
        """Relative standard error of one plan's race median, %: ``sqrt(pi/2) sigma / sqrt(rounds)``, ``sigma`` the
        race's step noise (IQR / 1.349) and ``rounds`` the median rounds a plan ran; ``None`` when unknown (what
        calibration weighs a measured plan's error by: ``planner.simulation.calibrate``)."""
        noise, rounds = self.noise_pct(), [len(self.step_ms(p)) for p in range(self.n_plans)]
        if not noise == noise or not rounds:
            return None
        return math.sqrt(math.pi / 2) * noise / 1.349 / math.sqrt(float(np.median(rounds)))

    def ratio_sigma(self) -> float:
        """Standard deviation of the per-round log ratios of the candidates alive to the default (pooled)."""
        pieces = [self.log_ratios(c, self.default) for c in self.candidates]
        pieces = [d - d.mean() for d in pieces if len(d) >= 2]
        if not pieces:
            return float("nan")
        pooled = np.concatenate(pieces)
        return float(math.sqrt((pooled ** 2).sum() / (len(pooled) - len(pieces))))
