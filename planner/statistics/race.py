"""The race: FSDP2's default and a few candidate plans, measured in interleaved rounds, the slow ones dropped.

Each round runs one step of every plan still in the race, in an order from a
balanced Latin square (Williams design): over a cycle of rounds every plan
follows every other one equally often, so no plan always inherits the same
predecessor's caches and allocator state. After each block of rounds the
race compares the plans by paired per-round log ratios (rounds are where the
machine's slow and fast moments are shared) and drops every candidate
significantly slower than the leader.

[Note: Dropping controls the family-wise error]
A candidate is dropped when a one-sided paired t-test on its per-round log
ratios to the leader's (``scipy.stats.ttest_1samp``, H1: slower) rejects.
Three corrections keep the chance of ever dropping the true best at most
``alpha``:
- the leader is chosen by the data (the luckiest plan so far), so each
  p-value is multiplied by the number of plans the candidate could have been
  compared with (a union bound over the pairs);
- Holm's step-down across the candidates tested at one look;
- ``alpha`` is split evenly over the looks the race can make (Bonferroni over
  repeated looks at growing data).
``tests/planner/test_race.py`` checks it on synthetic races.
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
        min_rounds: rounds before the first look (a t-test needs a few).
        block_rounds: rounds between looks.
        max_rounds: the race stops after this many rounds.
        time_budget_s: the race stops once it has run this long (s), at the
            end of a block; ``None``: no limit.
    """

    alpha: float = 0.05
    min_rounds: int = 4
    block_rounds: int = 2
    max_rounds: int = 12
    time_budget_s: float | None = None

    @property
    def looks(self) -> int:
        """How many times the race can look: at ``min_rounds``, then every ``block_rounds`` up to ``max_rounds``."""
        if self.max_rounds < self.min_rounds:
            return 1
        return 1 + math.ceil((self.max_rounds - self.min_rounds) / self.block_rounds)


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


def holm(p_values: dict[int, float], alpha: float) -> set[int]:
    """Holm's step-down: the keys whose hypotheses are rejected at family-wise level ``alpha``."""
    rejected: set[int] = set()
    ordered = sorted(p_values.items(), key=lambda kv: kv[1])
    for rank, (key, p) in enumerate(ordered):
        if p > alpha / (len(ordered) - rank):
            break
        rejected.add(key)
    return rejected


@dataclass
class Race:
    """A race of ``n_plans`` plans; plan ``default`` (FSDP2's default) is the baseline and is never dropped.

    Ask it :meth:`orders` for the next rounds, feed it with :meth:`record`
    (one round's step times, ms), and :meth:`look` when it is :meth:`due`.
    """

    n_plans: int
    settings: RaceSettings = field(default_factory=RaceSettings)
    default: int = 0
    rounds: list[dict[int, float]] = field(default_factory=list)
    alive: list[int] = field(init=False)
    dropped: dict[int, int] = field(default_factory=dict)  # plan -> rounds run when dropped
    _design_start: int = 0

    def __post_init__(self) -> None:
        if self.n_plans < 1 or not 0 <= self.default < self.n_plans:
            raise PlannerError(f"a race needs FSDP2's default among its plans, found {self.n_plans} plans")
        self.alive = list(range(self.n_plans))

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

    def due(self) -> bool:
        """Whether the rounds so far end a block: time to :meth:`look`."""
        n = len(self.rounds)
        return n >= self.settings.min_rounds and (n - self.settings.min_rounds) % self.settings.block_rounds == 0

    def look(self) -> list[int]:
        """Drop the candidates significantly slower than the leader; returns them ([Note: Dropping controls ...])."""
        from scipy.stats import ttest_1samp

        leader = self.leader()
        others = len(self.alive) - 1
        p_values = {}
        for c in self.candidates:
            if c == leader:
                continue
            d = self.log_ratios(c, leader)
            if len(d) < 2 or np.ptp(d) == 0.0:
                continue
            p = float(ttest_1samp(d, 0.0, alternative="greater").pvalue)
            p_values[c] = min(1.0, p * others)
        out = sorted(holm(p_values, self.settings.alpha / self.settings.looks))
        for c in out:
            self.alive.remove(c)
            self.dropped[c] = len(self.rounds)
        if out:
            self._design_start = len(self.rounds)
        return out

    def finished(self, elapsed_s: float = 0.0) -> bool:
        """One candidate or none left, ``max_rounds`` run, or the time budget spent."""
        s = self.settings
        return (len(self.candidates) <= 1 or len(self.rounds) >= s.max_rounds
                or (s.time_budget_s is not None and elapsed_s >= s.time_budget_s))

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

    def ratio_sigma(self) -> float:
        """Standard deviation of the per-round log ratios of the candidates alive to the default (pooled)."""
        pieces = [self.log_ratios(c, self.default) for c in self.candidates]
        pieces = [d - d.mean() for d in pieces if len(d) >= 2]
        if not pieces:
            return float("nan")
        pooled = np.concatenate(pieces)
        return float(math.sqrt((pooled ** 2).sum() / (len(pooled) - len(pieces))))
