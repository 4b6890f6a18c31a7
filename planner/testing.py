"""Fixtures shared by the tests and ``bench/``, as Optuna keeps ``optuna/testing/``.

Synthetic profiles with hand-chosen figures (no ranks, no torch), and a study
database with measured and simulated trials.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from planner.artifacts.config import StudyConfig
from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.profile import ModuleProfile, Profile
from planner.statistics.launches import ConfirmLaunch, Spread
from planner.statistics.looks import MAX_LAUNCHES, Looks
from planner.statistics.race import RaceSettings
from planner.statistics.schedule import ConfirmSettings, Schedule
from planner.statistics.verdict import Chain, Verdict, confirm_launches

if TYPE_CHECKING:
    import numpy as np

    from planner.artifacts.plan import Plan
    from planner.study import MeasuredStage, MeasuredTrial, SearchSpace
    from planner.study.queries import BestPlan
    from planner.study.session import TuneOutcome, TuningSession


def synthetic_profile(
    n_blocks: int = 2,
    fwd: float | list[float] = 10.0,
    bwd: float | list[float] = 20.0,
    ag: float | list[float] = 5.0,
    rs: float | list[float] = 3.0,
    device: str = "cpu",
    unsharded_bytes: int = 1000,
    grad_bytes: int = 0,
    activation_bytes: int = 0,
    optimizer_ms: float = 0.0,
    blocks: list[str] | None = None,
) -> Profile:
    """Root ``""`` (no compute, no communication) plus blocks ``b0..b{n-1}`` (or named ``blocks``).

    Per-block figures (ms, bytes) are a scalar (same for all) or a list (one
    per block). Sharded bytes and optimizer state are 0, so the predicted
    peak is what the plan keeps alive.
    """
    def at(x, i):
        return x[i] if isinstance(x, list) else x

    blocks = blocks or [f"b{i}" for i in range(n_blocks)]
    modules = {"": ModuleProfile("", 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, 0, 0, reshard_after_forward=False)}
    for i, b in enumerate(blocks):
        modules[b] = ModuleProfile(
            b, at(fwd, i), at(bwd, i), at(fwd, i), at(bwd, i), at(ag, i), at(rs, i),
            unsharded_bytes, 0, grad_bytes, activation_bytes, reshard_after_forward=True,
        )
    fqns = ("", *blocks)
    fp = Fingerprint(fqns, tuple(100 for _ in fqns), tuple(400 for _ in fqns), 2, device, ("torch.float32",), "test")
    return Profile(fp, ("", *blocks), (*blocks, ""), modules, optimizer_ms)


def assert_one_line_error(code: int, err: str, needle: str, exit_code: int = 2) -> None:
    """Failed as bad input should: exit ``exit_code``, one line ``error: ...`` with ``needle``, no traceback."""
    assert code == exit_code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err
    assert "Traceback" not in err


def study_config(directory: str | Path, name: str = "s", **fields) -> StudyConfig:
    """A study ``name`` stored in ``directory/<name>.db`` on the test MLP; ``fields``: :meth:`StudyConfig.build`'s."""
    fields = {"storage": f"sqlite:///{directory}/{name}.db", "factory": "runtime.reference_workloads:mlp", **fields}
    return StudyConfig.build(directory=str(directory), name=name, **fields)


def make_study_db(directory: str | Path, profile: Profile, sim_trials: int, space: SearchSpace) -> str:
    """A study ``s`` in ``directory/s.db`` with simulated trials and 3 measured plans (100, 80, 90 ms), the survivor
    confirmed faster in one fresh launch (ratio exactly 0.8); its URL.

    One :class:`~planner.study.session.TuningSession` through :func:`drive_tune`; ``space``: the ``uniform``
    space (``search_spaces.get_space("uniform")``).
    """
    from planner.study.session import TuningSession

    config = study_config(directory, sim_trials=sim_trials, measured_trials=2)
    outputs = Path(directory) / "make_study_db"  # the session's plan and profile, out of the tests' way
    outputs.mkdir(exist_ok=True)
    session = TuningSession(config, profile, space, job="test", plan_out=str(outputs / "s.plan.json"),
                            profile_out=str(outputs / "s.profile.json"))
    drive_tune(session, [100.0, 80.0, 90.0], ratio=0.8)
    return config.storage_url


def drive_tune(session: TuningSession, step_ms: Sequence[float] | StepTime, ratio: float, launches: int = 1,
               peak_bytes: Sequence[int] | None = None) -> tuple[list[MeasuredTrial], TuneOutcome, BestPlan]:
    """``tune``'s path: :func:`drive_round` with the survivor left for ``launches`` fresh confirmation launches, each
    of whose rounds take ``ratio`` times FSDP2's default's 100 ms (``prefetch-planner confirm``), then the
    conclusion that writes the study's recommendation to the session's plan file
    (``planner.study.confirmation.conclude``).

    Returns:
        The trials asked, the round's outcome, and the study's recommendation after the conclusion.
    """
    session.confirm_launches = launches
    asked, outcome = drive_round(session, step_ms, peak_bytes)
    return asked, outcome, conclude_launches(session.config, session.job, ratio, launches, session.plan_out)


def conclude_launches(config: StudyConfig, job: str, ratio: float, launches: int, plan_out: str) -> BestPlan:
    """Job ``job``'s survivor confirmed in ``launches`` fresh launches whose rounds take ``ratio`` times FSDP2's
    default's 100 ms (what ``prefetch-planner confirm`` records), then concluded; the study's recommendation,
    written to ``plan_out``."""
    from planner.study.confirmation import conclude, pending, record_launch

    waiting = pending(config, job)
    if waiting is not None:
        for _ in range(launches):
            record_launch(config, waiting.survivor.provenance.trial,
                          ConfirmLaunch([100.0 * ratio] * waiting.rounds, [100.0] * waiting.rounds))
    return conclude(config, job, plan_out)[1]


StepTime = Callable[[int, "MeasuredTrial"], float]


def _step_time(step_ms: Sequence[float] | StepTime) -> StepTime:
    """``step_ms[i]`` for the trial at position ``i`` of the round, or the callable itself."""
    if callable(step_ms):
        return step_ms
    return lambda i, trial: step_ms[i]


def _run_schedule(schedule: Schedule, trials: Sequence[MeasuredTrial], step_ms: StepTime, ranks: int
                  ) -> tuple[list[list[float]], list[list[list[float]]]]:
    """What ``runtime.measuring.measure.run_schedule`` does on real ranks, with synthetic step times: every rank takes
    the
    same time, so the max across ranks is that time."""
    times: list[list[float]] = [[] for _ in trials]
    while (block := schedule.next_block()) is not None:
        recorded = []
        for order in block:
            ms = {i: step_ms(i, trials[i]) for i in order}
            recorded.append(ms)
            for i in order:
                times[i].append(ms[i])
        schedule.record(recorded)
    return times, [[list(t) for _ in range(ranks)] for t in times]


def run_round(stage: MeasuredStage, asked: list[MeasuredTrial], step_ms: Sequence[float] | StepTime,
              ranks: int = 2, peak_bytes: Sequence[int] | None = None, launches: int = 0) -> list[Plan]:
    """Tell ``stage`` a whole round of ``asked`` (FSDP2's default first) with synthetic step times.

    The round's schedule uses the stage's ``[measure]`` settings. With
    ``step_ms[i]`` ms every step for trial ``i``, the race drops a plan slower
    than the leader in every round once its sign test can tell, and the
    confirmation's ratio is exact: in this process (``launches = 0``), or
    left for ``launches`` fresh launches (:func:`conclude_launches`). Returns
    the told plans (:func:`planner.study.provenance.measured_plans`).
    """
    from planner.study.provenance import measured_plans

    measure = stage.config.measure
    schedule = Schedule(len(asked), measure.race_settings(), measure.confirm_settings(launches=launches),
                        clock=lambda: 0.0)
    times, per_rank = _run_schedule(schedule, asked, _step_time(step_ms), ranks)
    trials = [(a.number, a.plan, a.predicted_ms, a.predicted_peak_bytes) for a in asked]
    measured = measured_plans(stage.config.name, trials, schedule, times, per_rank, peak_bytes)
    stage.tell(asked, measured, times, per_rank)
    return [m.plan for m in measured]


def drive_round(session: TuningSession, step_ms: Sequence[float] | StepTime, peak_bytes: Sequence[int] | None = None,
                ranks: int = 2) -> tuple[list[MeasuredTrial], TuneOutcome]:
    """Play the ranks' part of the rank protocol (``runtime.measuring.protocol``) for ``session``, with synthetic steps.

    ``session.prepare()``; every plan applies on every rank; the measured
    peaks are ``peak_bytes`` (by position among the asked trials; default:
    each trial's predicted peak); ``over_budget``; ``start``; the schedule's
    blocks, step ``k`` of the trial at position ``i`` taking ``step_ms[i]``
    ms (or ``step_ms(i, trial)``) on every rank; ``tell``; ``finish``.

    Returns:
        The trials the session asked for, and its outcome.
    """
    asked = session.prepare()
    peaks = list(peak_bytes) if peak_bytes is not None else [a.predicted_peak_bytes for a in asked]
    over = session.over_budget(asked, peaks)
    keep = [i for i in range(len(asked)) if i not in over]
    kept = [asked[i] for i in keep]
    schedule = session.start(kept, [peaks[i] for i in keep])
    step_time = _step_time(step_ms)
    times, per_rank = _run_schedule(schedule, kept, lambda j, trial: step_time(keep[j], trial), ranks)
    told = session.tell(kept, times, per_rank)
    outcome = session.finish(told, {asked[i].number: reason for i, reason in over.items()})
    session.close()
    return asked, outcome


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
    schedule = Schedule(len(effects), race or RaceSettings(), confirm or ConfirmSettings(), clock=lambda: 0.0)
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
        schedule = Schedule(plans, RaceSettings(), ConfirmSettings(launches=0), earlier=earlier, clock=lambda: 0.0)
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
    """

    survivor: int | None
    offset: float
    applied: bool
    reverted_at: int | None

    @property
    def applied_at_end(self) -> bool:
        """Applied after the confirmation and never reverted."""
        return self.applied and self.reverted_at is None


def first_run(rng: np.random.Generator, effects: Sequence[float], tau: float = 0.0, noise: float = 0.01,
              stall_p: Sequence[float] | None = None, stall_x: float = 1.5, watch_steps: int = 500,
              drift: float = 0.03, drift_rho: float = 0.95) -> FirstRun:
    """One in-loop tuner's first run on synthetic steps: the race and the confirmation through
    :class:`~planner.statistics.schedule.Schedule` (the in-loop tuner's defaults: ``planner.study.in_loop``), the
    in-process decision (``planner.statistics.watch.in_process``), then ``watch_steps`` watched steps
    (:class:`~planner.statistics.watch.Watch`).

    Plan ``p``'s step takes ``100 ms * effects[p] * exp(offset_p)`` (``offset_p ~ N(0, tau^2)`` in this process,
    0 for FSDP2's default, plan 0) times the machine's speed (a slow drift: log-AR(1) of standard deviation
    ``drift`` and step-to-step correlation ``drift_rho``, shared by whatever runs at that moment) and the step's
    own noise (lognormal ``noise``); with chance ``stall_p[p]`` a step takes ``stall_x`` times as long.
    """
    import math

    import numpy as np

    from planner.statistics.watch import Watch, in_process, watch_every
    from planner.study.in_loop import in_loop_config

    offsets = np.concatenate([[0.0], rng.normal(0.0, tau, len(effects) - 1)]) if tau else np.zeros(len(effects))
    stalls = list(stall_p) if stall_p is not None else [0.0] * len(effects)
    speed = [0.0]

    def step(p: int) -> float:
        speed[0] = drift_rho * speed[0] + math.sqrt(1 - drift_rho ** 2) * rng.normal(0.0, drift)
        ms = 100.0 * effects[p] * math.exp(offsets[p] + speed[0] + rng.normal(0.0, noise))
        return ms * stall_x if stalls[p] and rng.random() < stalls[p] else ms

    measure = in_loop_config("first-run", "sqlite://").measure  # the in-loop tuner's own settings
    schedule = Schedule(len(effects), measure.race_settings(), measure.confirm_settings(0), clock=lambda: 0.0)
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
        for check in watch.next_block():
            if check:
                default_ms = step(schedule.default)
            else:
                plan_ms, plan_steps = plan_ms + step(survivor), plan_steps + 1
        watched += plan_steps + 1
        if watch.record(plan_ms, plan_steps, default_ms).reverted:
            return FirstRun(survivor, float(offsets[survivor]), True, watched)
    return FirstRun(survivor, float(offsets[survivor]), True, None)


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
