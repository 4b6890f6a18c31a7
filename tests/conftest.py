"""Shared test helpers: synthetic profiles with hand-chosen figures."""

from __future__ import annotations

import pytest

from planner.profile import Fingerprint, ModuleProfile, Profile


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
) -> Profile:
    """Root ``""`` (no compute, no communication) plus blocks ``b0..b{n-1}``.

    Per-block figures are a scalar (same for all) or a list (one per block).
    Sharded bytes and optimizer state are 0, so the predicted peak is what
    the plan keeps alive.
    """
    def at(x, i):
        return x[i] if isinstance(x, list) else x

    blocks = [f"b{i}" for i in range(n_blocks)]
    modules = {"": ModuleProfile("", 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, 0, 0, reshard_after_forward=False)}
    for i, b in enumerate(blocks):
        modules[b] = ModuleProfile(
            b, at(fwd, i), at(bwd, i), at(fwd, i), at(bwd, i), at(ag, i), at(rs, i),
            unsharded_bytes, 0, grad_bytes, activation_bytes, reshard_after_forward=True,
        )
    fqns = ("", *blocks)
    fp = Fingerprint(fqns, tuple(100 for _ in fqns), tuple(400 for _ in fqns), 2, device, ("torch.float32",), "test")
    return Profile(fp, ("", *blocks), (*blocks, ""), modules, optimizer_ms)


@pytest.fixture
def make_profile():
    return synthetic_profile


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server on loopback (``tests/postgres.py``); yields a factory of fresh database URLs.

    Skipped where no server binaries are installed, except under CI
    (``CI`` set), where ``.ci/run`` installs them and a skip would hide a gap.
    """
    import os

    from tests.postgres import PostgresServer

    import importlib.util

    try:
        if importlib.util.find_spec("psycopg2") is None:
            raise ImportError("psycopg2 is not installed: pip install -e '.[test]'")
        server = PostgresServer()
    except (ImportError, FileNotFoundError) as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"no PostgreSQL here: {e}")
    server.start()
    counter = iter(range(1_000_000))
    yield lambda: server.create_database(f"planner_{next(counter)}")
    server.stop()


def make_study_db(directory, profile: Profile, sim_trials: int) -> str:
    """A study ``s`` in ``directory/s.db`` with simulated trials and 3 measured plans (100, 80, 90 ms); its URL."""
    from planner.config import StudyConfig
    from planner.study import MeasuredStage, open_storage, select_candidates, simulated_stage

    config = StudyConfig(name="s", storage=f"sqlite:///{directory}/s.db", factory="runtime.workloads:mlp",
                         sim_trials=sim_trials, measured_trials=2, directory=str(directory))
    storage = open_storage(config.storage, config)
    sim = simulated_stage(profile, config, storage, show_progress_bar=False)
    stage = MeasuredStage(config, storage, profile, job="test")
    asked = stage.ask(select_candidates(sim, profile, "uniform", 2))
    stage.tell(asked, [[100.0], [80.0], [90.0]], [[[100.0]], [[80.0]], [[90.0]]])
    stage.close()
    storage.engine.dispose()
    return config.storage
