"""The full command line's jobs (tune, profile) before any rank starts: bad input is one line and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from jobs.cli import main
from planner.errors import StudyConfigError
from planner.testing import assert_one_line_error
from runtime.ranks.rank import check_runnable

GOOD = '[study]\nname = "s"\n[workload]\nfactory = "{factory}"\n'
STUDIES = Path(__file__).parents[2] / "studies"


def _invoke(args):
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


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
    assert_one_line_error(code, err, needle)
    assert not (tmp_path / "s.db").exists()  # nothing written


def test_tune_missing_and_malformed_toml(tmp_path):
    assert_one_line_error(*_invoke(["tune", str(tmp_path / "missing.toml")])[::2], "cannot read study file")
    assert_one_line_error(*_invoke(["tune", _toml(tmp_path, "[study\n")])[::2], "not valid TOML")


def test_tune_unreachable_storage(tmp_path):
    path = _toml(tmp_path, GOOD.format(factory="runtime.reference_workloads:mlp"))
    code, _, err = _invoke(["tune", path, "--storage", "sqlite:////no/such/dir/x.db"])
    assert_one_line_error(code, err, "folder '/no/such/dir' does not exist")


def test_cli_overrides_are_validated(tmp_path):
    path = _toml(tmp_path, GOOD.format(factory="runtime.reference_workloads:mlp"))
    code, _, err = _invoke(["tune", path, "--sim-trials", "-1"])
    assert_one_line_error(code, err, "[search] sim_trials must be >= 0, found -1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine can run the GPU study")
@pytest.mark.parametrize("command", ["tune", "profile"])
def test_a_gpu_study_on_a_cpu_machine_is_refused_before_any_rank_starts(tmp_path, command):
    """studies/llama-gpu.toml here: one line, exit 2, nothing written (it used to print two tracebacks, exit 1)."""
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", command, str(STUDIES / "llama-gpu.toml"),
                           "--storage" if command == "tune" else "-o",
                           f"sqlite:///{tmp_path}/x.db" if command == "tune" else str(tmp_path / "p.json")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert_one_line_error(proc.returncode, proc.stderr, "[launch] backend = 'nccl' needs CUDA GPUs")
    assert "set backend = 'gloo'" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_runnable("nccl", 2)
    with pytest.raises(StudyConfigError, match=r"nproc_per_node = 4 .* this machine has 2; set nproc_per_node = 2"):
        check_runnable("nccl", 4)
    check_runnable("gloo", 64)  # gloo runs anywhere


def test_console_script_error_is_one_line(tmp_path):
    """The installed entry point, not only click's runner."""
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.cli", "tune", str(tmp_path / "missing.toml")],
        capture_output=True, text=True,
    )
    assert_one_line_error(proc.returncode, proc.stderr, "cannot read study file")


_EXIT_AFTER_RANKS = """
import atexit, sys
from jobs.launching import exit_with_ranks
atexit.register(lambda: print("teardown ran", flush=True))
exit_with_ranks(int(sys.argv[1]), "tuning", (2, 3, 130))
"""


@pytest.mark.parametrize(("ranks_code", "exit_code", "teardown"), [(130, 130, False), (2, 2, True), (-6, 1, True)])
def test_an_interrupted_launch_exits_130_without_the_interpreters_teardown(ranks_code, exit_code, teardown):
    done = subprocess.run([sys.executable, "-c", _EXIT_AFTER_RANKS, str(ranks_code)], capture_output=True, text=True,
                          cwd=Path(__file__).parents[2], timeout=120)
    assert done.returncode == exit_code, done.stderr
    assert ("teardown ran" in done.stdout) == teardown
    assert ("rank failed with exit code -6" in done.stderr) == (ranks_code == -6)
