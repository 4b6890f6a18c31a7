"""Study TOML parsing and validation."""

from __future__ import annotations

import pytest

from planner.config import load_study_config
from planner.errors import StudyConfigError

GOOD = """
[study]
name = "s"
[workload]
factory = "runtime.reference_workloads:mlp"
kwargs = { dim = 64 }
[search]
space = "per_module"
sim_trials = 7
"""


def test_defaults_and_overrides(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(GOOD)
    c = load_study_config(f)
    assert c.storage_url == f"sqlite:///{tmp_path}/s.db"
    assert (c.search.space, c.search.sim_trials, c.search.measured_trials, c.launch.nproc_per_node,
            c.workload.kwargs) == ("per_module", 7, 3, 2, {"dim": 64})
    c2 = load_study_config(f, storage="sqlite:///x.db", sim_trials=None, measured_trials=1)
    assert (c2.storage_url, c2.search.sim_trials, c2.search.measured_trials) == ("sqlite:///x.db", 7, 1)
    assert c.default_output(".plan.json") == str(tmp_path / "s.plan.json")


@pytest.mark.parametrize(
    "text, message",
    [
        ("[study\nname=1", "not valid TOML"),
        ('[study]\nname = "s"\n', "factory is required"),
        (GOOD + "[bogus]\nx = 1\n", r"unknown table \[bogus\]"),
        (GOOD.replace("sim_trials = 7", "sim_trials = 7\ntrials = 3"), "unknown key"),
        (GOOD.replace("sim_trials = 7", 'sim_trials = "many"'), "sim_trials must be int"),
        (GOOD.replace('"per_module"', '"nope"'), "unknown search space 'nope'"),
        (GOOD + "[measure]\nsteps = 0\n", "steps must be >= 1"),
    ],
)
def test_bad_toml(tmp_path, text, message):
    f = tmp_path / "s.toml"
    f.write_text(text)
    with pytest.raises(StudyConfigError, match=message):
        load_study_config(f)


def test_missing_file(tmp_path):
    with pytest.raises(StudyConfigError, match="cannot read study file"):
        load_study_config(tmp_path / "none.toml")


def test_reference_studies_parse():
    from pathlib import Path

    studies = Path(__file__).parents[2] / "studies"
    c = load_study_config(studies / "llama-cpu.toml")
    assert c.workload.factory == "runtime.reference_workloads:llama" and c.launch.nproc_per_node == 2
    assert load_study_config(studies / "gpt2-cpu.toml").workload.factory == "runtime.reference_workloads:gpt2"
    gpu = load_study_config(studies / "llama-gpu.toml")
    assert gpu.launch.backend == "nccl" and gpu.name == "llama-gpu"
