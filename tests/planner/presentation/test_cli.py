"""planner's commands (simulate, studies): one line ``error: ...`` and exit 2 for bad input; query output."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from planner.artifacts.plan import Plan
from planner.presentation.cli import main
from planner.statistics.launches import DEFAULT_SPREAD
from planner.statistics.looks import boundaries
from planner.testing import assert_one_line_error, make_study_db, synthetic_profile
from search_spaces import get_space


def _invoke(args, cwd=None):
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def test_simulate_errors(tmp_path, make_profile):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1, "fingerp')
    assert_one_line_error(*_invoke(["simulate", str(bad)])[::2], "not valid JSON")
    assert_one_line_error(*_invoke(["simulate", str(tmp_path / "none.json")])[::2], "cannot read profile")
    profile = tmp_path / "p.json"
    make_profile(n_blocks=2).to_json(profile)
    other = tmp_path / "other.json"
    Plan.default(make_profile(n_blocks=3)).to_json(other)
    assert_one_line_error(*_invoke(["simulate", str(profile), str(other)])[::2], "FSDP module count")
    code, out, _ = _invoke(["simulate", str(profile), "--json"])
    assert code == 0 and '"step_ms": 86.0' in out


@pytest.fixture(scope="module")
def study_db(tmp_path_factory):
    """Built once for the module: the commands below only read it."""
    return make_study_db(tmp_path_factory.mktemp("study"), synthetic_profile(n_blocks=3), sim_trials=30,
                         space=get_space("uniform"))


def test_studies_queries(study_db, tmp_path):
    code, out, _ = _invoke(["studies", "list", "--storage", study_db])
    # confirmed in one fresh launch, steps exactly 0.8 of the default's: the interval is the floor's spread alone, at
    # the boundary of a chain whose horizon is that one launch (tune's launches, all run before its one look)
    q = boundaries((1,), max_launches=1)[0]
    interval = f"0.800 [{0.8 * math.exp(-q * DEFAULT_SPREAD.tau):.3f}, {0.8 * math.exp(q * DEFAULT_SPREAD.tau):.3f}]"
    assert code == 0 and "s " in out and interval in out and "faster (1)" in out and "100.0" in out
    code, out, _ = _invoke(["studies", "show", "s", "--storage", study_db])
    assert code == 0 and "3 measured trials, 30 simulated trials" in out and "default" in out
    code, out, _ = _invoke(["studies", "best", "s", "--storage", study_db])
    assert code == 0 and "confirmed faster than FSDP2's default" in out and "ratio 0.800, 95% CI" in out
    assert "race (not confirmed): median 80.0 ms, FSDP2's default 100.0 ms" in out
    assert "reshard_after_backward True  separate_reduce_scatter_group False" in out  # every global knob
    target = tmp_path / "best.json"
    code, out, _ = _invoke(["studies", "export", "s", "-o", str(target), "--storage", study_db])
    assert code == 0 and Plan.load(target).provenance.measured_ms == 80.0


def test_studies_unknown_study(study_db, tmp_path):
    assert_one_line_error(*_invoke(["studies", "best", "nope", "--storage", study_db])[::2], "no study 'nope'")
    assert_one_line_error(
        *_invoke(["studies", "show", "s", "--storage", f"sqlite:///{tmp_path}/x.db"])[::2], "no database")


def test_planner_does_not_import_torch():
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, planner, planner.presentation.cli, planner.study, planner.storages, planner.artifacts.config, "
            "search_spaces, jobs.cli; print('torch' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert proc.stdout.strip() == "False"


def test_query_and_simulate_commands_run_without_torch(study_db, tmp_path, make_profile):
    """The console script's query and simulate commands, with torch made unimportable."""
    profile = tmp_path / "p.json"
    make_profile(n_blocks=2).to_json(profile)
    blocker = tmp_path / "no_torch"
    blocker.mkdir()
    (blocker / "torch.py").write_text("raise ImportError('torch is not installed here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), *sys.path])}
    for args in (["studies", "list", "--storage", study_db], ["studies", "best", "s", "--storage", study_db],
                 ["simulate", str(profile), "--json"]):
        proc = subprocess.run([sys.executable, "-m", "jobs.cli", *args], capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr


def test_studies_forget_says_what_would_go_then_removes_it_and_keeps_the_clusters_calibration(tmp_path, make_profile):
    """Without --yes: one line naming what would go, exit 2, nothing removed. With it: the study, its simulated
    stage and the planner's rows are gone (``studies best`` finds no study, as the next start would), the
    calibration launches stay; another study in the same database is untouched."""
    import sqlalchemy as sa

    from planner.storages.models import CalibrationLaunchRow

    url = make_study_db(tmp_path, make_profile(n_blocks=2), sim_trials=10, space=get_space("uniform"))
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.insert(CalibrationLaunchRow).values(
            device_type="cpu", backend="gloo", world_size=2, mesh="", pair="default/default", study_name="s",
            launch_json="{}"))
    before = {t: _count(engine, t) for t in ("planner_plans", "planner_measured_runs", "planner_calibration_launches")}
    assert before["planner_plans"] == 3 and before["planner_measured_runs"] == 3

    code, out, err = _invoke(["studies", "forget", "s", "--storage", url])
    assert_one_line_error(code, err, "study 's': 3 measured and 10 simulated trials, ")
    assert "would be removed; pass --yes to remove them" in err
    assert {t: _count(engine, t) for t in before} == before  # nothing removed
    assert _invoke(["studies", "best", "s", "--storage", url])[0] == 0

    code, out, _ = _invoke(["studies", "forget", "s", "--storage", url, "--yes"])
    assert code == 0 and out.startswith("forgot study 's': 3 measured and 10 simulated trials")
    assert _count(engine, "planner_plans") == 0 and _count(engine, "planner_measured_runs") == 0
    assert _count(engine, "planner_calibration_launches") == before["planner_calibration_launches"]
    assert_one_line_error(*_invoke(["studies", "best", "s", "--storage", url])[::2], "no study 's'")
    import optuna

    assert optuna.get_all_study_names(url) == []
    assert_one_line_error(*_invoke(["studies", "forget", "s", "--storage", url, "--yes"])[::2], "no study 's'")
    engine.dispose()


def _count(engine, table: str) -> int:
    import sqlalchemy as sa

    with engine.connect() as conn:
        return conn.execute(sa.text(f"select count(*) from {table}")).scalar_one()
