"""Synthetic chains through the product's statistics, as the tests and ``bench.verdicts`` draw them: races and
confirmations on synthetic steps (``Schedule``), launches drawn from a stated model, the restart chain, the first
run in one process and the calibrated chain; and the tolerances a simulated rate is held to.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.statistics.launches import ConfirmLaunch, Spread
from planner.statistics.looks import MAX_LAUNCHES, Looks
from planner.statistics.race import RaceSettings
from planner.statistics.schedule import ConfirmSettings, Schedule
from planner.statistics.verdict import Chain, Verdict, confirm_launches

if TYPE_CHECKING:
    import numpy as np


def order_stream(rng: np.random.Generator) -> random.Random:
    """The stream a synthetic schedule draws its confirmation orders from (:attr:`Schedule.orders`): seeded from a
    child of ``rng`` (``Generator.spawn``), so the schedule repeats with ``rng``'s seed and ``rng``'s own draws are
    not consumed."""
    return random.Random(int(rng.spawn(1)[0].integers(2 ** 63)))


def synthetic_schedule(effects: list[float], noise_iqr_pct: float, rng: np.random.Generator,
                       race: RaceSettings | None = None, confirm: ConfirmSettings | None = None) -> Schedule:
    """Run a :class:`planner.statistics.schedule.Schedule` to the end on synthetic steps; returns it.

    Plan ``p``'s steps take ``100 ms * effects[p]`` times independent
    lognormal noise whose interquartile range / median is ``noise_iqr_pct``
    (no shared round effect: the hardest case for paired rounds). Plan 0 is
    the default; ``race`` and ``confirm`` default to the settings' defaults.
    """
    import math

    sigma = noise_iqr_pct / 100.0 / 1.3490  # the IQR of a normal is 1.349 sigma
    schedule = Schedule(len(effects), race or RaceSettings(), confirm or ConfirmSettings(), clock=lambda: 0.0,
                        orders=order_stream(rng))
    while (block := schedule.next_block()) is not None:
        schedule.record([{p: 100.0 * effects[p] * math.exp(rng.normal(0.0, sigma)) for p in order}
                         for order in block])
    return schedule

# Synthetic confirmations ([Note: Between-launch spread] in planner.statistics.verdict): round i of launch l runs
# FSDP2's default at base * s_i * e_d and the plan at base * (1 - gain) * s_i * exp(delta_l) * e_p, where s_i is a
# slowness both plans share in a round, e_d and e_p each plan's own step noise (lognormal), delta_l ~ N(0, tau^2)
# the plan's offset in that process; with chance stall_p a plan step takes stall_x times as long.


@dataclass(frozen=True)
class LaunchModel:
    """How synthetic confirmation launches are drawn (the model in the comment above).

    Attributes:
        gain: the plan's speed-up on its steps that do not stall (0.07 = 7%).
        tau: between-launch spread of its log ratio.
        noise: each plan's own step noise (lognormal sigma; 0.04 = about 4%).
        shared: the slowness a round's two steps share (lognormal sigma).
        stall_p: the chance a plan step stalls.
        stall_x: how much longer a stalled step takes (1.5 = 50%).
        rounds: paired rounds per launch.
        base_ms: FSDP2's default's typical step, ms.
    """

    gain: float = 0.0
    tau: float = 0.0
    noise: float = 0.04
    shared: float = 0.05
    stall_p: float = 0.0
    stall_x: float = 1.5
    rounds: int = 24
    base_ms: float = 100.0

    @property
    def total_ratio(self) -> float:
        """The plan's true total-time ratio to the default in a typical launch (``delta = 0``): what the
        confirmation estimates."""
        return (1 - self.gain) * (1 + self.stall_p * (self.stall_x - 1))

    def draw(self, confirmations: int, launches: int, seed: int = 0) -> np.ndarray:
        """``confirmations`` synthetic confirmations of ``launches`` launches: an array of shape
        ``(confirmations, launches, 2, rounds)``, ``[..., 0, :]`` the plan's step times and ``[..., 1, :]`` the
        default's, ms."""
        import numpy as np

        rng = np.random.default_rng(seed)
        shape = (confirmations, launches, self.rounds)
        s = self.base_ms * np.exp(rng.normal(0.0, self.shared, shape))
        default = s * np.exp(rng.normal(0.0, self.noise, shape))
        offset = np.exp(rng.normal(0.0, self.tau, (confirmations, launches, 1)))
        plan = (1 - self.gain) * s * offset * np.exp(rng.normal(0.0, self.noise, shape))
        if self.stall_p:
            plan = plan * np.where(rng.random(shape) < self.stall_p, self.stall_x, 1.0)
        return np.stack([plan, default], axis=2)


def as_launches(confirmation: np.ndarray, picked: int = 0) -> list[ConfirmLaunch]:
    """One drawn confirmation (``(launches, 2, rounds)``) as ``confirm_launches``' launches, the first ``picked`` of
    them marked as their race's own process."""
    return [ConfirmLaunch(list(launch[0]), list(launch[1]), picked=i < picked) for i, launch in enumerate(confirmation)]


def at_most(rate: float, runs: int) -> int:
    """The most events of nominal probability ``rate`` that ``runs`` simulated trials may show: the rate plus 3
    standard errors (the tests' tolerance for a simulated error rate)."""
    import math

    return math.floor(runs * (rate + 3 * math.sqrt(rate * (1 - rate) / runs)))


def at_least(rate: float, runs: int) -> int:
    """The fewest events of target probability ``rate`` that ``runs`` simulated trials must show: the rate less 3
    standard errors (the tests' tolerance for a simulated power)."""
    import math

    return math.ceil(runs * (rate - 3 * math.sqrt(rate * (1 - rate) / runs)))


def restart_path(model: LaunchModel, spread: Spread, runs: int, seed: int, launches: int = MAX_LAUNCHES) -> int:
    """How many of ``runs`` chains of ``model``'s fresh launches are ever called faster when looked at after each
    launch, 1 to ``launches`` ([Note: Looks spent over the restart chain]), the study's spread being ``spread``.

    Every chain is looked at to the end (no provisional gate: an upper bound on the restart path's rate).
    """
    ever = 0
    for drawn in model.draw(runs, launches, seed):
        chain = as_launches(drawn)
        earlier: tuple[int, ...] = ()
        for k in range(1, launches + 1):
            if confirm_launches(chain[:k], 0.0, spread, Looks(earlier)).verdict == Verdict.FASTER:
                ever += 1
                break
            earlier = (*earlier, k)
    return ever


def restart_chain(rng: np.random.Generator, candidates: int, tau: float = 0.04, noise: float = 0.04,
                  shared: float = 0.05) -> tuple[list[Verdict], float | None]:
    """One in-loop restart chain of ``candidates`` plans with nothing to gain, decided as the study decides it.

    Each start is one process, its race and confirmation run through
    :class:`~planner.statistics.schedule.Schedule` on synthetic steps: every
    plan's step is FSDP2's default's (100 ms) times its offset in that process
    (``N(0, tau^2)`` on the log scale, per plan and per process), a slowness
    the round's steps share (lognormal ``shared``) and the step's own noise
    (lognormal ``noise``). The first start races the candidates and confirms
    the survivor in the same process; while the verdict leaves a pending plan
    (:class:`~planner.study.recommendation.JobVerdict`), the next start races
    it against the default alone and confirms it there, its chain's earlier
    launches and looks from :func:`planner.study.evidence.chain_of`.

    Returns:
        Each start's verdict (empty when the first race dropped every candidate), and the first survivor's offset
        in its own process (``None`` then).
    """
    import math

    import numpy as np

    from planner.study.evidence import chain_of
    from planner.study.recommendation import JobVerdict
    from planner.study.records import MeasuredTrialRecord

    def start(plans: int, earlier: dict[int, Chain]) -> tuple[Schedule, np.ndarray]:
        offsets = np.concatenate([[0.0], rng.normal(0.0, tau, plans - 1)])
        schedule = Schedule(plans, RaceSettings(), ConfirmSettings(launches=0), earlier=earlier, clock=lambda: 0.0,
                            orders=order_stream(rng))
        while (block := schedule.next_block()) is not None:
            rounds = []
            for order in block:
                common = math.exp(rng.normal(0.0, shared))
                rounds.append({p: 100.0 * common * math.exp(offsets[p] + rng.normal(0.0, noise)) for p in order})
            schedule.record(rounds)
        return schedule, offsets

    schedule, offsets = start(candidates + 1, {})
    if schedule.confirmation is None:
        return [], None
    survivor_offset = float(offsets[schedule.survivor])
    records: dict[int, MeasuredTrialRecord] = {}
    verdicts: list[Verdict] = []
    previous: int | None = None
    while True:
        c = schedule.confirmation
        number = len(records)
        records[number] = MeasuredTrialRecord(number=number, job=f"start-{number}", reconfirms=previous,
                                              confirmation=c, confirm_launches=[schedule.confirm_launch()])
        verdicts.append(c.verdict)
        job = JobVerdict(f"start-{number}", MeasuredTrialRecord(is_default=True), records[number], number)
        if job.recommended is not None or job.pending is None:  # applied, or the chain ends with the default
            return verdicts, survivor_offset
        previous = number
        schedule, _ = start(2, {1: chain_of(records, previous)})
        if schedule.confirmation is None:  # the recheck's race dropped it
            return verdicts, survivor_offset


@dataclass(frozen=True)
class FirstRun:
    """How one synthetic first run of the in-loop tuner ended ([Note: Applied in the process that measured it] in
    ``planner.statistics.watch``).

    Attributes:
        survivor: the race's survivor (``None``: every candidate dropped).
        offset: the survivor's log offset in this process (its true log ratio to the default here, before stalls).
        applied: the survivor ran for the rest of the process after the confirmation.
        reverted_at: the watched step at which the watch reverted it (``None``: never, within the steps run).
        watch_ratio: the watch's ratio at its end (``nan`` without a watch).
    """

    survivor: int | None
    offset: float
    applied: bool
    reverted_at: int | None
    watch_ratio: float = float("nan")

    @property
    def applied_at_end(self) -> bool:
        """Applied after the confirmation and never reverted."""
        return self.applied and self.reverted_at is None


def first_run(rng: np.random.Generator, effects: Sequence[float], tau: float = 0.0, noise: float = 0.01,
              stall_p: Sequence[float] | None = None, stall_x: float = 1.5, watch_steps: int = 500,
              drift: float = 0.03, drift_rho: float = 0.95, carry: float = 0.0) -> FirstRun:
    """One in-loop tuner's first run on synthetic steps: the race and the confirmation through
    :class:`~planner.statistics.schedule.Schedule` (the in-loop tuner's defaults: ``planner.study.in_loop``), the
    in-process decision (``planner.statistics.watch.in_process``), then ``watch_steps`` watched steps
    (:class:`~planner.statistics.watch.Watch`).

    Plan ``p``'s step takes ``100 ms * effects[p] * exp(offset_p)`` (``offset_p ~ N(0, tau^2)`` in this process,
    0 for FSDP2's default, plan 0) times the machine's speed (a slow drift: log-AR(1) of standard deviation
    ``drift`` and step-to-step correlation ``drift_rho``, shared by whatever runs at that moment) and the step's
    own noise (lognormal ``noise``); with chance ``stall_p[p]`` a step takes ``stall_x`` times as long. A step right
    after another plan's carries ``carry`` of it: its effect is ``(1 - carry) effects[p] + carry effects[q]``, ``q``
    the plan before (the state a switch carries: [Note: The watch] in ``planner.statistics.watch``).
    """
    import math

    import numpy as np

    from planner.statistics.watch import Watch, WatchStep, in_process, watch_every
    from planner.study.in_loop import in_loop_config

    offsets = np.concatenate([[0.0], rng.normal(0.0, tau, len(effects) - 1)]) if tau else np.zeros(len(effects))
    stalls = list(stall_p) if stall_p is not None else [0.0] * len(effects)
    speed, last = [0.0], [0]

    def step(p: int) -> float:
        speed[0] = drift_rho * speed[0] + math.sqrt(1 - drift_rho ** 2) * rng.normal(0.0, drift)
        q, last[0] = last[0], p
        effect = effects[p] if q == p else (1 - carry) * effects[p] + carry * effects[q]
        ms = 100.0 * effect * math.exp(offsets[p] + speed[0] + rng.normal(0.0, noise))
        return ms * stall_x if stalls[p] and rng.random() < stalls[p] else ms

    measure = in_loop_config("first-run", "sqlite://").measure  # the in-loop tuner's own settings
    schedule = Schedule(len(effects), measure.race_settings(), measure.confirm_settings(0), clock=lambda: 0.0,
                        orders=order_stream(rng))
    while (block := schedule.next_block()) is not None:
        schedule.record([{p: step(p) for p in order} for order in block])
    survivor = schedule.survivor
    if schedule.confirmation is None or survivor is None:
        return FirstRun(None, 0.0, False, None)
    here = in_process(schedule.confirm_ms[survivor], schedule.confirm_ms[schedule.default])
    if not here.faster:
        return FirstRun(survivor, float(offsets[survivor]), False, None)
    watch = Watch(watch_every(here.ratio), seed=int(rng.integers(1 << 30)))
    watched = 0
    while watched < watch_steps:
        plan_ms, plan_steps, default_ms = 0.0, 0, 0.0
        for kind in watch.next_block():
            ms = step(schedule.default if kind.runs_default else survivor)
            if kind is WatchStep.DEFAULT:
                default_ms = ms
            elif kind is WatchStep.PLAN:
                plan_ms, plan_steps = plan_ms + ms, plan_steps + 1
        watched += watch.every
        state = watch.record(plan_ms, plan_steps, default_ms)
        if state.reverted:
            return FirstRun(survivor, float(offsets[survivor]), True, watched, state.ratio)
    return FirstRun(survivor, float(offsets[survivor]), True, None, watch.state().ratio)


def calibrated_chain(model: LaunchModel, runs: int, seed: int, calibration_launches: int = 12,
                     pairs: int = 3, tau_calibration: float | None = None, resolve: float = 0.03,
                     tune_launches: int | None = 0) -> tuple[int, float, int]:
    """How many of ``runs`` chains of ``model``'s fresh launches are ever called faster on a cluster calibrated as the
    product calibrates it, and the mean floor and horizon they ran under.

    Each run: a calibration of ``calibration_launches`` fresh launches spread over ``pairs`` unselected pairs
    (``planner.study.cluster_spread.calibration_pairs``: FSDP2's default against a copy of itself and against
    unselected plans, each pair's launches drawn with nothing to gain at ``tau_calibration``, default
    ``model.tau``), turned into the cluster's spread (``spread_of``: the floor and the evidence); the chain's design
    at the per-round noise ``model`` implies (``planner.statistics.design``); then the chain. ``tune_launches``
    ``0``: the in-loop chain, one fresh launch per later start and a look after each, up to the design's horizon;
    ``None``: ``tune``'s, the design's launches then one look.

    Returns:
        The chains ever called faster, the mean floor (log scale) and the mean horizon.
    """
    import math

    import numpy as np

    from planner.statistics.design import confirmation_design
    from planner.study.cluster_spread import ClusterKey, calibration_pairs, spread_of

    rng = np.random.default_rng(seed)
    null = LaunchModel(tau=model.tau if tau_calibration is None else tau_calibration, noise=model.noise,
                       shared=model.shared, rounds=model.rounds)
    kinds = calibration_pairs(calibration_launches, [f"u{i}" for i in range(pairs - 1)])
    sigma = math.sqrt(2) * model.noise  # the per-round log ratio's noise: two steps' own noise
    ever, floors, horizons = 0, [], []
    for _ in range(runs):
        drawn = null.draw(1, calibration_launches, int(rng.integers(1 << 31)))[0]
        groups: dict[str, list[ConfirmLaunch]] = {}
        for kind, launch in zip(kinds, as_launches(drawn), strict=True):
            groups.setdefault(kind, []).append(launch)
        cluster = spread_of(ClusterKey("cuda", "nccl", 8), groups)
        design = confirmation_design(sigma, resolve, (model.rounds, model.rounds), tune_launches, cluster.spread,
                                     cluster.floor)
        floors.append(cluster.floor)
        horizons.append(design.horizon)
        chain = as_launches(model.draw(1, design.horizon, int(rng.integers(1 << 31)))[0])
        looks_at = range(1, design.horizon + 1) if tune_launches == 0 else [design.horizon]
        earlier: tuple[int, ...] = ()
        for k in looks_at:
            looks = Looks(earlier, horizon=design.horizon)
            if confirm_launches(chain[:k], 0.0, cluster.spread, looks, cluster.spread).verdict == Verdict.FASTER:
                ever += 1
                break
            earlier = (*earlier, k)
    return ever, float(np.mean(floors)), float(np.mean(horizons))
