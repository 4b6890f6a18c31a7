"""Study TOML parsing and validation."""

from __future__ import annotations

import pydantic
import pytest

from planner.artifacts.config import Backend, StudyConfig, load_study_config
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
        (
            GOOD.replace('"per_module"', '"nope"'),
            r"\[search\] space must be one of 'uniform', 'per_module' or 'assign', found 'nope'",
        ),
        (GOOD + "[measure]\nsteps = 0\n", "steps must be >= 1"),
        (GOOD + '[launch]\nbackend = "mpi"\n', r"\[launch\] backend must be one of 'gloo' or 'nccl', found 'mpi'"),
        (GOOD + "[launch]\nnproc_per_node = true\n", r"\[launch\] nproc_per_node must be int, found True"),
        (GOOD + "[launch]\nnproc_per_node = 2.0\n", r"\[launch\] nproc_per_node must be int, found 2.0"),
        (
            GOOD.replace("sim_trials = 7", 'sim_trials = 7\nsampler = "cma"'),
            r"\[search\] sampler must be one of 'tpe', 'nsga2' or 'random', found 'cma'",
        ),
        (GOOD + "[study]\n", "Cannot declare"),  # TOML itself refuses a table twice
        (GOOD + "[measure]\nalpha = 0.0\n", r"\[measure\] alpha must be > 0.0, found 0.0"),
        (GOOD + '[measure]\nalpha = "low"\n', r"\[measure\] alpha must be a number, found 'low'"),
        (GOOD + "[measure]\nmin_rounds = 6\nmax_rounds = 4\n", r"\[measure\] max_rounds \(4\) must be >= min_rounds"),
        ('study = 3\n[workload]\nfactory = "x:y"\n', "study must be a table"),
        (
            '[study]\nname = "s"\nheartbeat_interval_s = 60\n[workload]\nfactory = "x:y"\n',
            r"\[study\] grace_period_s \(60\) must exceed heartbeat_interval_s \(60\)",
        ),
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

    studies = Path(__file__).parents[3] / "studies"
    c = load_study_config(studies / "llama-cpu.toml")
    assert c.workload.factory == "runtime.reference_workloads:llama" and c.launch.nproc_per_node == 2
    assert load_study_config(studies / "gpt2-cpu.toml").workload.factory == "runtime.reference_workloads:gpt2"
    gpu = load_study_config(studies / "llama-gpu.toml")
    assert gpu.launch.backend == "nccl" and gpu.name == "llama-gpu"


def test_every_error_is_one_line_naming_file_table_and_key(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(GOOD.replace("sim_trials = 7", "sim_trials = 7\ntrials = 3\nbogus = 1"))
    with pytest.raises(StudyConfigError) as info:
        load_study_config(f)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(f))
    assert "unknown key(s) ['bogus', 'trials'] in [search]; keys there are" in message and "sim_trials" in message


def test_overrides_are_validated_like_the_file(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(GOOD)
    with pytest.raises(StudyConfigError, match=r"\[search\] measured_trials must be >= 0, found -2"):
        load_study_config(f, measured_trials=-2)
    with pytest.raises(StudyConfigError, match="unknown key 'trials'"):
        load_study_config(f, trials=3)


def test_build_puts_flat_keys_in_their_tables_with_the_same_defaults(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text('[study]\nname = "s"\n[workload]\nfactory = "runtime.reference_workloads:mlp"\n')
    from_file = load_study_config(f)
    built = StudyConfig.build(directory=tmp_path, name="s", factory="runtime.reference_workloads:mlp")
    assert built == from_file  # one place per default: the table models'
    assert built.launch.backend == Backend.GLOO and built.measure.steps == 5 and built.study.grace_period_s == 60
    tuned = StudyConfig.build(name="t", factory="x:y", sim_trials=9, backend="nccl", steps=2)
    assert (tuned.search.sim_trials, tuned.launch.backend, tuned.measure.steps) == (9, Backend.NCCL, 2)
    with pytest.raises(pydantic.ValidationError):
        tuned.search.sim_trials = 3  # frozen: validated once, then plain typed objects


def test_the_ranks_read_back_the_validated_config_the_launcher_wrote():
    """``tune`` validates the TOML and its command-line overrides once and hands the ranks that object
    (``jobs.cli._handed_over``): what they read back is the same config, overrides included."""
    from pathlib import Path

    for toml in sorted(Path("studies").glob("*.toml")):
        config = load_study_config(toml, storage="sqlite:////tmp/x.db", memory_budget="+10%", sim_trials=7)
        again = StudyConfig.from_validated_json(config.to_validated_json())
        assert again == config and again.search.memory_budget == "+10%" and again.storage_url == "sqlite:////tmp/x.db"
    with pytest.raises(StudyConfigError, match="does not load .* launch the job again"):
        StudyConfig.from_validated_json('{"study": {}}')
