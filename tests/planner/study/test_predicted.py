"""Predicted plans ([Note: Predicted plans are raced, never recommended]): ``tune --target`` writes one of provenance
``predicted`` into study ``NAME.predicted``; the recommendation and ``load_best_plan``'s query never return it; a
session given it races it first, and only a confirmation on the real ranks makes it the recommendation."""

from __future__ import annotations

import json

import optuna
import pytest
from click.testing import CliRunner

from jobs.cli import main
from planner.artifacts.plan import Plan, Source
from planner.artifacts.target import load_target
from planner.errors import PlanMismatchError, StudyNotFoundError
from planner.simulation.what_if import Scenario
from planner.study.in_loop import predicted_start
from planner.study.predicted import predict_for_target, predicted_for, predicted_plans, store_predicted
from planner.study.queries import best_plan, best_plan_for
from planner.study.session import TuningSession
from planner.testing import drive_tune, study_config, synthetic_profile
from search_spaces import get_space

TARGET = dict(world_size=4, ranks_per_node=2)


def predicted(tmp_path, profile):
    config = study_config(tmp_path, sim_trials=60, measured_trials=2, space="per_module")
    return config, predict_for_target(config, Scenario.of(profile, load_target("cpu-emulated-1gbit", **TARGET)),
                                      get_space("per_module"))


def test_a_predicted_plan_is_stored_apart_and_never_recommended(tmp_path):
    profile = synthetic_profile(n_blocks=4)
    config, p = predicted(tmp_path, profile)
    pv = p.plan.provenance
    assert pv.source == Source.PREDICTED and "cpu-emulated-1gbit" in pv.target and pv.params
    assert pv.band_ms[0] <= pv.predicted_ms <= pv.band_ms[1] and pv.predicted_ms <= p.default_ms
    assert p.plan.fingerprint.world_size == 4  # made for the target
    store_predicted(config.storage_url, config.name, p)
    assert [r.plan.behaviour_key() for r in predicted_plans(config.storage_url, config.name)] == [
        p.plan.behaviour_key()]
    assert predicted_for(config.storage_url, config.name, profile.fingerprint).provenance.target == pv.target
    with pytest.raises(StudyNotFoundError, match="studies there: none"):  # load_best_plan's query: nothing measured
        best_plan_for(config.storage_url, config.name, profile.fingerprint)
    assert predicted_for(config.storage_url, config.name, synthetic_profile(n_blocks=3).fingerprint) is None


def test_a_session_races_the_predicted_plan_first_and_only_a_confirmation_recommends_it(tmp_path):
    profile = synthetic_profile(n_blocks=4)
    config, p = predicted(tmp_path, profile)
    store_predicted(config.storage_url, config.name, p)
    path = tmp_path / "predicted.plan.json"
    p.plan.to_json(path)
    plan = predicted_start(str(path), profile.fingerprint)  # any world size: it was predicted for another
    session = TuningSession(config, profile, get_space("per_module"), job="j", plan_out=str(tmp_path / "out.json"),
                            profile_out="")
    session.start_from = plan
    steps = lambda i, trial: 100.0 if trial.plan.is_default_for(profile) else (70.0 if i == 1 else 95.0)  # noqa: E731
    asked, outcome, best = drive_tune(session, steps, ratio=0.7)
    assert asked[0].plan.is_default_for(profile)
    first = asked[1]
    assert first.plan.behaviour_key() == get_space("per_module").suggest(
        optuna.trial.FixedTrial(plan.provenance.params), profile).behaviour_key()
    assert not best.keeps_baseline and best.plan.provenance.trial == first.number  # confirmed: now it is recommended
    assert best.plan.provenance.source == Source.MEASURED
    trial = optuna.load_study(study_name=config.name, storage=config.storage_url).trials[first.number]
    assert "cpu-emulated-1gbit" in trial.user_attrs["predicted_for"]
    assert best_plan(config.storage_url, config.name, profile.fingerprint).plan.provenance.trial == first.number


def test_start_from_refuses_a_plan_of_another_model_or_without_parameters(tmp_path):
    profile = synthetic_profile(n_blocks=4)
    other = tmp_path / "other.json"
    Plan.default(synthetic_profile(n_blocks=3)).with_provenance(params={}).to_json(other)
    with pytest.raises(PlanMismatchError, match="is a plan of another model"):
        predicted_start(str(other), profile.fingerprint)
    bare = tmp_path / "bare.json"
    Plan.default(profile).to_json(bare)
    with pytest.raises(PlanMismatchError, match="carries no search-space parameters"):
        predicted_start(str(bare), profile.fingerprint)


def test_tune_target_writes_a_predicted_plan_and_studies_show_lists_it_apart(tmp_path):
    profile = synthetic_profile(n_blocks=4)
    profile.to_json(tmp_path / "s.profile.json")
    toml = tmp_path / "s.toml"
    toml.write_text('[study]\nname = "s"\n[workload]\nfactory = "runtime.reference_workloads:mlp"\n'
                    '[search]\nspace = "per_module"\nsim_trials = 40\n')
    runner = CliRunner()
    result = runner.invoke(main, ["tune", str(toml), "--target", "cpu-emulated-1gbit", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "provenance 'predicted'" in result.output and "band [" in result.output
    written = json.loads((tmp_path / "s.predicted.plan.json").read_text())
    assert written["provenance"]["source"] == "predicted" and written["provenance"]["band_ms"]
    shown = runner.invoke(main, ["studies", "show", "s", "--storage", f"sqlite:///{tmp_path}/s.db"])
    assert shown.exit_code == 0 and "nothing measured yet" in shown.output
    assert "predicted plans (tune --target; not measured, never recommended" in shown.output
    best = runner.invoke(main, ["studies", "best", "s", "--storage", f"sqlite:///{tmp_path}/s.db"])
    assert best.exit_code != 0 or "FSDP2's default" in best.output  # never the predicted plan


def test_a_predicted_plan_fits_the_memory_budget(tmp_path):
    """Under an absolute budget the plan written for the target is predicted within it; under a budget no plan's
    predicted peak on the target fits (every plan there holds at least 450 MiB), none is written."""
    from planner.errors import MemoryBudgetError

    profile = synthetic_profile(n_blocks=4, ag=30.0, unsharded_bytes=100 * 2**20)
    scenario = Scenario.of(profile, load_target("cpu-emulated-1gbit", **TARGET))

    def plan_under(budget: str) -> Plan:
        config = study_config(tmp_path, name=budget, sim_trials=60, measured_trials=2, space="per_module",
                              memory_budget=budget)
        return predict_for_target(config, scenario, get_space("per_module")).plan

    assert plan_under("460MiB").provenance.predicted_peak_bytes <= 460 * 2**20
    with pytest.raises(MemoryBudgetError, match="no plan predicted for the target fits the memory budget 400MiB"):
        plan_under("400MiB")
