"""How a confirmation is sized: its rounds per launch, its fresh launches, and the horizon of its chain of looks.

[Note: Launches against rounds]
A launch's log ratio varies by ``sigma^2 / n + tau^2`` (``n`` rounds of
per-round noise ``sigma``, the cluster's spread ``tau`` between launches,
[Note: Between-launch spread] in :mod:`planner.statistics.launches`), so
rounds shrink only the first term: where the spread dominates, more and
shorter launches resolve a gain that no number of rounds in one launch can.
The design sizes the chain for the spread the verdict would use (the
study's, never below the cluster's floor: its calibrated bound, else its
device's prior), computing power as the verdict decides (:func:`power`):
- ``tune`` with fresh launches runs them all before its one look, so its
  chain's horizon is its own launches and that look spends the whole error;
  among 1 to :data:`MOST_LAUNCHES` launches it takes the cheapest in steps
  (``launches x (2 rounds + launch_cost_steps)``) that reaches 80% power
  for ``resolve``;
- a confirmation in the process that raced (the in-loop tuner, ``tune``
  under torchrun) gets its fresh launches from later starts, one each, so
  its chain's horizon is the fewest launches that reach that power;
- where no design reaches it, :data:`MAX_LAUNCHES` launches (more would
  buy little power at a cost that grows with them); the reports state the
  gain the chain can find.
Torch-free; the horizon is fixed before any of the chain's fresh launches
is looked at, so the looks' error stays spent as planned ([Note: Looks spent
over the restart chain] in :mod:`planner.statistics.looks`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from planner.statistics.launches import DEFAULT_SPREAD, Spread
from planner.statistics.looks import MAX_LAUNCHES, MOST_LAUNCHES, Looks
from planner.statistics.verdict import POWER, confirmation_rounds, power


@dataclass(frozen=True)
class ConfirmDesign:
    """A confirmation's size ([Note: Launches against rounds]).

    Attributes:
        launches: fresh launches this job runs (0: the confirmation runs in the process that raced).
        rounds: paired rounds per launch.
        horizon: the fresh launches the chain plans for (:attr:`Looks.horizon`).
        power: the chance the chain's last look calls a plan ``resolve`` faster at the floor's spread.
        resolve: the gain it was sized for (0.03 = 3%).
        sigma: the per-round noise it was sized at (log ratio; the race's), ``nan`` unknown.
        tau: the between-launch spread it was sized at (log scale): the study's, never below the cluster's floor.
    """

    launches: int
    rounds: int
    horizon: int
    power: float
    resolve: float
    sigma: float = float("nan")
    tau: float = float("nan")

    @property
    def resolves(self) -> bool:
        """Whether the design reaches 80% power for :attr:`resolve`."""
        return self.power >= POWER

    def steps(self, launch_cost_steps: int = 0) -> int:
        """Its steps: two a round in each fresh launch (one in-process launch when :attr:`launches` is 0), and
        ``launch_cost_steps`` per fresh launch."""
        return max(1, self.launches) * 2 * self.rounds + self.launches * launch_cost_steps


@functools.lru_cache(maxsize=4096)
def confirmation_design(sigma: float, resolve: float = 0.03, bounds: tuple[int, int] = (8, 30),
                        launches: int | None = None, spread: Spread = DEFAULT_SPREAD,
                        floor: float = DEFAULT_SPREAD.tau, launch_cost_steps: int = 20) -> ConfirmDesign:
    """The confirmation's size for per-round noise ``sigma`` at the cluster's floor ([Note: Launches against
    rounds]).

    Args:
        sigma: standard deviation of the per-round log ratios, as the race measured it (``nan``: unknown, the
            most rounds).
        resolve: the total-time gain to find "faster" with 80% power (0.03 = 3%).
        bounds: ``(fewest, most)`` rounds per launch (``confirmation_rounds``).
        launches: fresh launches this job runs: ``None`` chooses 1 to :data:`MOST_LAUNCHES`; ``0``: none, the
            confirmation runs in the process that raced; a count: that many.
        spread: the study's spread before the confirmation.
        floor: the cluster's floor of the spread (log scale).
        launch_cost_steps: what a fresh launch costs beyond its rounds (process start, model build, warm-up), in
            steps.

    Raises:
        ValueError: a negative ``launches`` (a count above :data:`MOST_LAUNCHES` is run as asked, its chain
            planned for it).
    """
    if launches is not None and launches < 0:
        raise ValueError(f"a confirmation runs 0 or more fresh launches, found {launches}")
    tau = max(floor, spread.tau)  # the worst spread the verdict allows for

    def sized(count: int) -> ConfirmDesign:
        looks = Looks(horizon=count)
        rounds = confirmation_rounds(sigma, resolve, bounds, count, spread, floor, looks, tau)
        found = power(count, rounds, resolve, sigma, spread, looks, tau, floor) if sigma == sigma else 0.0
        return ConfirmDesign(count if launches != 0 else 0, rounds, count, found, resolve, sigma, tau)

    if launches:
        return sized(launches)
    options = [sized(count) for count in range(1, MOST_LAUNCHES + 1)]
    reaching = [d for d in options if d.resolves]
    if launches == 0:  # in process: the fewest later starts
        if reaching:
            return reaching[0]
        return sized(MAX_LAUNCHES)
    if reaching:
        return min(reaching, key=lambda d: (d.steps(launch_cost_steps), d.launches))
    return sized(MAX_LAUNCHES)
