"""Fixtures shared by the tests and ``bench/``, as Optuna keeps ``optuna/testing/``.

Synthetic profiles with hand-chosen figures (no ranks, no torch), and a study
database with measured and simulated trials. The synthetic chains through the statistics are in
:mod:`planner.testing.chains`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from planner.artifacts.config import StudyConfig
from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.profile import ModuleProfile, Profile
from planner.statistics.launches import ConfirmLaunch
from planner.statistics.schedule import Schedule

if TYPE_CHECKING:
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
    """What ``runtime.measuring.round.MeasuredRound`` does with the blocks on real ranks, with synthetic step times:
    every rank takes the same time, so the max across ranks is that time. The confirmation's orders are seeded, so a
    noisy ``step_ms`` repeats."""
    schedule.orders.seed(0)
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
    the plans_measured plans (:func:`planner.study.provenance.measured_plans`).
    """
    from planner.study.provenance import measured_plans

    measure = stage.config.measure
    schedule = Schedule(len(asked), measure.race_settings(), measure.confirm_settings(launches=launches),
                        clock=lambda: 0.0)
    times, per_rank = _run_schedule(schedule, asked, _step_time(step_ms), ranks)
    trials = [(a.number, a.plan, a.candidate.predicted_ms, a.candidate.predicted_peak_bytes) for a in asked]
    measured = measured_plans(stage.config.name, trials, schedule, peak_bytes)
    stage.tell(asked, measured, times, per_rank)
    return [m.plan for m in measured]


def drive_round(session: TuningSession, step_ms: Sequence[float] | StepTime, peak_bytes: Sequence[int] | None = None,
                ranks: int = 2) -> tuple[list[MeasuredTrial], TuneOutcome]:
    """Play the ranks' part of the rank protocol (``runtime.measuring.round``) for ``session``, with synthetic steps.

    ``session.prepare()``; every plan applies on every rank; the measured
    peaks are ``peak_bytes`` (by position among the asked trials; default:
    each trial's predicted peak); ``over_budget``; ``start``; the schedule's
    blocks, step ``k`` of the trial at position ``i`` taking ``step_ms[i]``
    ms (or ``step_ms(i, trial)``) on every rank; ``tell``; ``finish``.

    Returns:
        The trials the session asked for, and its outcome.
    """
    asked = session.prepare()
    peaks = list(peak_bytes) if peak_bytes is not None else [a.candidate.predicted_peak_bytes for a in asked]
    over = session.over_budget(asked, peaks)
    keep = [i for i in range(len(asked)) if i not in over]
    kept = [asked[i] for i in keep]
    schedule = session.start(kept, [peaks[i] for i in keep])
    step_time = _step_time(step_ms)
    times, per_rank = _run_schedule(schedule, kept, lambda j, trial: step_time(keep[j], trial), ranks)
    plans_measured = session.tell(kept, times, per_rank)
    outcome = session.finish(plans_measured, {asked[i].number: reason for i, reason in over.items()})
    session.close()
    return asked, outcome
