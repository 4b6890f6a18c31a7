"""The CLI: one line ``error: ...`` on stderr and exit 2 for bad input; query output."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from jobs.cli import main
from planner.plan import Plan
from planner.testing import make_study_db

GOOD = '[study]\nname = "s"\n[workload]\nfactory = "{factory}"\n'


def _invoke(args, cwd=None):
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def _assert_one_line_error(code, err, needle):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err
    assert "Traceback" not in err


def _toml(tmp_path, text):
    f = tmp_path / "s.toml"
    f.write_text(text)
    return str(f)


@pytest.mark.parametrize(
    "factory, needle",
    [
        ("no_such_pkg.mod:fn", "cannot import workload module 'no_such_pkg.mod'"),
        ("runtime.reference_workloads:nope", "has no function 'nope'"),
        ("not-a-spec", "must look like 'package.module:function'"),
    ],
)
def test_tune_unknown_factory(tmp_path, factory, needle):
    code, _, err = _invoke(["tune", _toml(tmp_path, GOOD.format(factory=factory))])
    _assert_one_line_error(code, err, needle)
    assert not (tmp_path / "s.db").exists()  # nothing written


def test_tune_missing_and_malformed_toml(tmp_path):
    _assert_one_line_error(*_invoke(["tune", str(tmp_path / "missing.toml")])[::2], "cannot read study file")
    _assert_one_line_error(*_invoke(["tune", _toml(tmp_path, "[study\n")])[::2], "not valid TOML")


def test_tune_unreachable_storage(tmp_path):
    path = _toml(tmp_path, GOOD.format(factory="runtime.reference_workloads:mlp"))
    code, _, err = _invoke(["tune", path, "--storage", "sqlite:////no/such/dir/x.db"])
    _assert_one_line_error(code, err, "folder '/no/such/dir' does not exist")


def test_simulate_errors(tmp_path, make_profile):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1, "fingerp')
    _assert_one_line_error(*_invoke(["simulate", str(bad)])[::2], "not valid JSON")
    _assert_one_line_error(*_invoke(["simulate", str(tmp_path / "none.json")])[::2], "cannot read profile")
    profile = tmp_path / "p.json"
    make_profile(n_blocks=2).to_json(profile)
    other = tmp_path / "other.json"
    Plan.default(make_profile(n_blocks=3)).to_json(other)
    _assert_one_line_error(*_invoke(["simulate", str(profile), str(other)])[::2], "FSDP module count")
    code, out, _ = _invoke(["simulate", str(profile), "--json"])
    assert code == 0 and '"step_ms": 86.0' in out


@pytest.fixture
def study_db(tmp_path, make_profile):
    return make_study_db(tmp_path, make_profile(n_blocks=3), sim_trials=30)


def test_studies_queries(study_db, tmp_path):
    code, out, _ = _invoke(["studies", "list", "--storage", study_db])
    assert code == 0 and "s " in out and "80.0" in out and "0.800" in out
    code, out, _ = _invoke(["studies", "show", "s", "--storage", study_db])
    assert code == 0 and "3 measured trials, 30 simulated trials" in out and "default" in out
    code, out, _ = _invoke(["studies", "best", "s", "--storage", study_db])
    assert code == 0 and "80.0 ms" in out and "FSDP2 default 100.0 ms" in out and "ratio 0.800" in out
    target = tmp_path / "best.json"
    code, out, _ = _invoke(["studies", "export", "s", "-o", str(target), "--storage", study_db])
    assert code == 0 and Plan.load(target).provenance.measured_ms == 80.0


def test_studies_unknown_study(study_db, tmp_path):
    _assert_one_line_error(*_invoke(["studies", "best", "nope", "--storage", study_db])[::2], "no study 'nope'")
    _assert_one_line_error(
        *_invoke(["studies", "show", "s", "--storage", f"sqlite:///{tmp_path}/x.db"])[::2], "no database")


def test_console_script_error_is_one_line(tmp_path):
    """The installed entry point, not only click's runner."""
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.cli", "tune", str(tmp_path / "missing.toml")],
        capture_output=True, text=True,
    )
    _assert_one_line_error(proc.returncode, proc.stderr, "cannot read study file")


def test_planner_does_not_import_torch():
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, planner, planner.cli, planner.study, search_spaces; "
                               "print('torch' in sys.modules)"],
        capture_output=True, text=True, check=True,
    )
    assert proc.stdout.strip() == "False"
