"""Fixtures shared by the tests and ``bench/``, as Optuna keeps ``optuna/testing/``.

Synthetic profiles with hand-chosen figures (no ranks, no torch), and a study
database with measured and simulated trials.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from planner.artifacts.config import StudyConfig
from planner.artifacts.profile import Fingerprint, ModuleProfile, Profile
from planner.statistics.race import RaceSettings
from planner.statistics.schedule import ConfirmSettings, Schedule

if TYPE_CHECKING:
    import numpy as np

    from planner.artifacts.plan import Plan
    from planner.study import MeasuredStage, MeasuredTrial, SearchSpace


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
    """A command failed as bad input should: exit ``exit_code``, one line ``error: ...`` containing ``needle``, no traceback."""
    assert code == exit_code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err
    assert "Traceback" not in err


def study_config(directory: str | Path, name: str = "s", **fields) -> StudyConfig:
    """A study ``name`` stored in ``directory/<name>.db`` on the test MLP; ``fields`` as in :meth:`StudyConfig.build`."""
    fields = {"storage": f"sqlite:///{directory}/{name}.db", "factory": "runtime.reference_workloads:mlp", **fields}
    return StudyConfig.build(directory=str(directory), name=name, **fields)


def make_study_db(directory: str | Path, profile: Profile, sim_trials: int, space: SearchSpace) -> str:
    """A study ``s`` in ``directory/s.db`` with simulated trials and 3 measured plans (100, 80, 90 ms); its URL.

    ``space``: the ``uniform`` space (``search_spaces.get_space("uniform")``).
    """
    from planner.storages import open_storage
    from planner.study import MeasuredStage, select_candidates, simulated_stage

    config = study_config(directory, sim_trials=sim_trials, measured_trials=2)
    storage = open_storage(config.storage_url, config)
    sim = simulated_stage(profile, config, storage, space, show_progress_bar=False)
    stage = MeasuredStage(config, storage, profile, "test", space)
    asked = stage.ask(select_candidates(sim, profile, space, 2))
    run_round(stage, asked, [100.0, 80.0, 90.0])
    stage.close()
    storage.engine.dispose()
    return config.storage_url


def run_round(stage: MeasuredStage, asked: list[MeasuredTrial], step_ms: list[float],
              ranks: int = 2, start: bool = True) -> list[Plan]:
    """Drive ``stage`` through a whole round where trial ``i`` always takes ``step_ms[i]`` ms on every rank.

    The race then drops no one (no spread, no test), runs ``max_rounds``, and
    the confirmation's ratio is exact. ``start=False``: the caller started
    the stage (with measured peaks). Returns what :meth:`MeasuredStage.tell` returns.
    """
    schedule = stage.start(asked) if start else stage.schedule
    times: list[list[float]] = [[] for _ in asked]
    while (block := schedule.next_block()) is not None:
        schedule.record([{i: step_ms[i] for i in order} for order in block])
        for order in block:
            for i in order:
                times[i].append(step_ms[i])
    return stage.tell(asked, times, [[t] * ranks for t in times])


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

