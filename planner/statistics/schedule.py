"""Rank 0's schedule of a measured round: the race's blocks, then the confirmation on fresh rounds.

The ranks ask :meth:`Schedule.next_block` for the next block of rounds (each
round: plan indices in running order), run them, and hand the step times back
through :meth:`Schedule.record`, until the schedule says it is done. The
schedule is pure Python: the same object drives the real ranks
(``runtime.measuring.round``) and the synthetic races of the tests.
"""

from __future__ import annotations

import enum
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from planner.errors import PlannerError
from planner.statistics.design import ConfirmDesign, confirmation_design
from planner.statistics.launches import DEFAULT_SPREAD, ConfirmLaunch, Spread
from planner.statistics.looks import Looks
from planner.statistics.race import Race, RaceSettings
from planner.statistics.verdict import Chain, Confirmation, confirm_launches, step_noise_pct


class Phase(enum.StrEnum):
    """Where a schedule is."""

    RACE = "race"
    CONFIRM = "confirm"
    DONE = "done"


@dataclass(frozen=True)
class ConfirmSettings:
    """How the confirmation is sized ([Note: Launches against rounds] in :mod:`planner.statistics.design`).

    Attributes:
        resolve: the speed-up it should find "faster" (0.03 = 3%) with 80% power.
        min_rounds, max_rounds: bounds on its rounds per launch (even counts, at least 6).
        launches: fresh launches it runs in ([Note: Confirming across launches]); ``0``: in the tuning process
            itself, after the race; ``None``: as many as its design chooses (1 to ``MOST_LAUNCHES``).
        spread: the study's spread between launches before the confirmation.
        floor: the cluster's floor of the spread (its calibrated bound, else its device's prior), log scale.
        launch_cost_steps: what a fresh launch costs beyond its rounds, in steps (the design's currency).
    """

    resolve: float = 0.03
    min_rounds: int = 8
    max_rounds: int = 30
    launches: int | None = 0
    spread: Spread = DEFAULT_SPREAD
    floor: float = DEFAULT_SPREAD.tau
    launch_cost_steps: int = 20

    def design(self, sigma: float) -> ConfirmDesign:
        """The confirmation's size for per-round log-ratio noise ``sigma`` (``planner.statistics.design``)."""
        return confirmation_design(sigma, self.resolve, (self.min_rounds, self.max_rounds), self.launches,
                                   self.spread, self.floor, self.launch_cost_steps)

    def rounds(self, sigma: float) -> int:
        """Rounds per launch for per-round log-ratio noise ``sigma`` (:meth:`design`)."""
        return self.design(sigma).rounds


def confirmation_orders(pair: tuple[int, int], rounds: int, rng: random.Random | None = None) -> list[list[int]]:
    """``rounds`` rounds of the two plans ``pair``: each pair of rounds runs both orders, which one first drawn at
    random, so no loop event every few steps lines up with one plan (an odd last round: its order drawn too)."""
    rng = rng or random.Random()
    out: list[list[int]] = []
    for _ in range(0, rounds, 2):
        first = list(pair) if rng.random() < 0.5 else list(pair[::-1])
        out += [first, first[::-1]]
    return out[:rounds]


@dataclass
class Schedule:
    """The measured round of ``n_plans`` plans, plan ``default`` being FSDP2's default.

    Attributes:
        race: the race (its rounds, drops, survivor).
        confirmation: set once the confirmation ran (``None`` if every candidate was dropped).
        confirm_ms: ``{plan: step times}`` of the confirmation rounds, ms.
        on_drop: called with each dropped plan and the rounds run (progress reports).
        earlier: per plan, its chain: earlier launches against the default and earlier looks (a re-confirmation
            across restarts); the in-process confirmation pools the launches with its own rounds.
        clock: seconds, for the race's time budget.
        orders: draws which plan runs first in each pair of confirmation rounds (:func:`confirmation_orders`);
            unseeded by default, seeded where a synthetic schedule must repeat.
        blocks: blocks handed out so far (progress bars: :meth:`planned_steps` changes only with a new block).
    """

    n_plans: int
    race_settings: RaceSettings = field(default_factory=RaceSettings)
    confirm_settings: ConfirmSettings = field(default_factory=ConfirmSettings)
    default: int = 0
    on_drop: Callable[[int, int], None] | None = None
    earlier: dict[int, Chain] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic
    orders: random.Random = field(default_factory=random.Random)
    race: Race = field(init=False)
    phase: Phase = field(init=False, default=Phase.RACE)
    confirmation: Confirmation | None = field(init=False, default=None)
    confirm_ms: dict[int, list[float]] = field(init=False, default_factory=dict)
    blocks: int = field(init=False, default=0)
    _started: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        # With FSDP2's default alone the race still runs its first block: the study's baseline figure.
        self.race = Race(self.n_plans, self.race_settings, self.default)

    @property
    def survivor(self) -> int | None:
        """The plan the race kept (confirmed or being confirmed); ``None`` before the race ends or if none is left."""
        return self.race.survivor() if self.phase != Phase.RACE else None

    def next_block(self) -> list[list[int]] | None:
        """The next rounds to run (plan indices per round, in order); ``None`` when the schedule is done."""
        if self._started is None:
            self._started = self.clock()
        if self.phase == Phase.RACE:
            block = self.race.orders(self.race.block())
        elif self.phase == Phase.CONFIRM:
            block = confirmation_orders((self.survivor, self.default), self.confirm_settings.rounds(
                self.race.ratio_sigma()), self.orders)
        else:
            return None
        self.blocks += 1
        return block

    def record(self, block: list[dict[int, float]]) -> None:
        """The step times of the block just run: per round, plan -> ms (max across ranks)."""
        if self.phase == Phase.RACE:
            for step_ms in block:
                self.race.record(step_ms)
            for plan in self.race.look():
                if self.on_drop is not None:
                    self.on_drop(plan, len(self.race.rounds))
            if self.race.finished(self.clock() - self._started):
                confirm_here = self.race.survivor() is not None and self.confirm_settings.launches == 0
                self.phase = Phase.CONFIRM if confirm_here else Phase.DONE
        elif self.phase == Phase.CONFIRM:
            survivor = self.survivor
            for step_ms in block:
                for plan, ms in step_ms.items():
                    self.confirm_ms.setdefault(plan, []).append(ms)
            noise = step_noise_pct([self.confirm_ms[survivor], self.confirm_ms[self.default]])
            chain = self.earlier.get(survivor, Chain())
            looks = chain.looks if chain.launches else Looks(horizon=self.horizon())
            settings = self.confirm_settings
            self.confirmation = confirm_launches([*chain.launches, self.confirm_launch()], noise, settings.spread,
                                                 looks, Spread(settings.floor, 0.0))
            self.phase = Phase.DONE

    def horizon(self) -> int:
        """The fresh launches a chain this round starts plans for (its design's horizon, sized at the race's
        noise)."""
        return self.confirm_settings.design(self.race.ratio_sigma()).horizon

    def confirm_launch(self) -> ConfirmLaunch:
        """This process's confirmation rounds as a launch, ``picked`` when its race chose the survivor among two
        candidates or more ([Note: The race's own process] in :mod:`planner.statistics.verdict`).

        Raises:
            PlannerError: the confirmation has not run.
        """
        survivor = self.survivor
        if survivor is None or survivor not in self.confirm_ms:
            raise PlannerError("no confirmation rounds ran in this process")
        return ConfirmLaunch(self.confirm_ms[survivor], self.confirm_ms[self.default], picked=self.n_plans > 2)

    def planned_steps(self) -> int:
        """Steps still to run at most, as known at the last block handed out (progress bars): the race's rest and the
        largest confirmation. The block in flight counts whole until :meth:`record` takes it."""
        if self.phase == Phase.DONE:
            return 0
        confirm_steps = 2 * self.confirm_settings.max_rounds if self.confirm_settings.launches == 0 else 0
        if self.phase == Phase.CONFIRM:
            return confirm_steps
        return self.race.rounds_left() * len(self.race.alive) + confirm_steps

