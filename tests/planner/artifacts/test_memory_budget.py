"""The memory budget: parsing, resolving, the infeasible case, candidates and measured trials within it, the front."""

from __future__ import annotations

import json

import pytest

from search_spaces import get_space
from click.testing import CliRunner

from planner.presentation.cli import main
from planner.errors import FailKind, StudyConfigError
from planner.artifacts.memory_budget import MemoryBudget, check_feasible
from planner.errors import MemoryBudgetError
from planner.storages import open_storage
from planner.study import MeasuredStage, pareto_front, select_candidates, simulated_stage, smallest_peak, study_trials
from planner.testing import run_round, study_config

MIB = 2**20


@pytest.mark.parametrize("text, default_peak, expected", [
    ("1.5GiB", None, int(1.5 * 2**30)), ("2000MB", None, 2 * 10**9), ("+150MiB", 1000 * MIB, 1150 * MIB),
    ("+10%", 1000 * MIB, 1100 * MIB), (" + 0 B ", 7, 7),
])
def test_budget_forms(text, default_peak, expected):
    assert MemoryBudget.parse(text).resolve(default_peak) == expected


@pytest.mark.parametrize("text", ["lots", "10%", "-5MiB", "1.5 GB extra", "", "+MiB"])
def test_bad_budget_is_one_line_naming_the_forms(text):
    with pytest.raises(StudyConfigError) as info:
        MemoryBudget.parse(text)
    assert "\n" not in str(info.value) and '"+150MiB"' in str(info.value)


def test_relative_budget_needs_a_measured_default_peak():
    with pytest.raises(MemoryBudgetError, match="lacks"):
        MemoryBudget.parse("+10%").resolve(None)


def test_budget_below_the_smallest_peak_names_it(make_profile):
    profile = make_profile(n_blocks=4, unsharded_bytes=100 * MIB)
    least = smallest_peak(profile, get_space("assign"))
    check_feasible(least, least, "x")  # exactly enough is enough
    with pytest.raises(MemoryBudgetError) as info:
        check_feasible(least - 1, least, "1GiB")
    assert f"{least / MIB:.1f} MiB" in str(info.value) and "\n" not in str(info.value)


def test_candidates_fit_the_budget_and_over_budget_trials_fail(make_profile, tmp_path):
    """Only plans predicted within the budget are raced; a measured peak over it fails the trial (not retried)."""
    # all-gathers (30 ms) longer than compute: keeping blocks unsharded after forward saves time, at a memory cost
    profile = make_profile(n_blocks=4, fwd=10.0, bwd=20.0, ag=30.0, rs=3.0, unsharded_bytes=100 * MIB)
    config = study_config(tmp_path, name="b", space="assign", sim_trials=80, measured_trials=2)
    storage = open_storage(config.storage_url, config)
    budget = smallest_peak(profile, get_space("assign")) + 100 * MIB  # room for one block more than the least
    sim = simulated_stage(profile, config, storage, get_space(config.search.space), show_progress_bar=False, budget_bytes=budget)
    assert any(t.values[1] > budget for t in sim.trials)  # the search saw plans over it ...
    candidates = select_candidates(sim, profile, get_space("assign"), 2, budget_bytes=budget)
    assert all(c.predicted_peak_bytes <= budget for c in candidates[1:])  # ... none is raced
    feasible = [t for t in sim.trials if "constraints:peak_over_budget_bytes" in t.system_attrs]
    assert len(feasible) == 80  # the new trials carry Optuna's constraint

    stage = MeasuredStage(config, storage, profile, job="test", space=get_space(config.search.space), budget_bytes=budget)
    asked = stage.ask(candidates)
    over = stage.over_budget(asked, [budget + 1, budget + 1, budget])  # the default is the baseline: never failed
    assert list(over) == [1] and "exceeds the memory budget" in over[1]
    kept = [a for j, a in enumerate(asked) if j not in over]
    schedule_peaks = [budget + 1, budget]
    stage.start(kept, schedule_peaks)
    told = run_round(stage, kept, [100.0, 90.0], start=False)
    stage.close()
    assert [p.provenance.measured_peak_bytes for p in told] == schedule_peaks
    assert all(p.provenance.memory_budget_bytes == budget for p in told)
    rows = {r["number"]: r for r in study_trials(config.storage_url, "b") if r["stage"] == "measured"}
    failed = rows[asked[1].number]
    assert failed["state"] == "FAIL" and failed["measured_peak_bytes"] == budget + 1
    assert stage.settled_keys() >= {stage.study.trials[asked[1].number].user_attrs["plan_key"]}  # FailKind.ERROR
    assert stage.study.trials[asked[1].number].user_attrs["fail_kind"] == FailKind.ERROR


def test_pareto_front_and_command(make_profile, tmp_path):
    rows = [{"number": n, "predicted_ms": ms, "predicted_peak_bytes": peak}
            for n, (ms, peak) in enumerate([(10, 5), (8, 6), (9, 7), (8, 6), (7, 9), (11, 4)])]
    assert [r["number"] for r in pareto_front(rows)] == [5, 0, 1, 4]

    profile = make_profile(n_blocks=4, fwd=10.0, bwd=20.0, ag=8.0, rs=3.0, unsharded_bytes=100 * MIB)
    config = study_config(tmp_path, name="p", space="assign", sim_trials=60, measured_trials=1)
    storage = open_storage(config.storage_url, config)
    sim = simulated_stage(profile, config, storage, get_space(config.search.space), show_progress_bar=False)
    stage = MeasuredStage(config, storage, profile, job="test", space=get_space(config.search.space))
    asked = stage.ask(select_candidates(sim, profile, get_space("assign"), 1))
    stage.start(asked, [300 * MIB, 400 * MIB])
    run_round(stage, asked, [100.0, 90.0], start=False)
    stage.close()
    png = tmp_path / "front.png"
    result = CliRunner().invoke(main, ["studies", "pareto", "p", "--storage", config.storage_url, "--png", str(png)])
    assert result.exit_code == 0, result.output
    front = pareto_front([r for r in study_trials(config.storage_url, "p") if r["stage"] == "simulated"])
    assert f"{len(front)} plans of 60 simulated trials" in result.output
    assert "400.0" in result.output and "FSDP2 default" in result.output
    assert png.stat().st_size > 10_000
    assert json.loads(json.dumps(front[0]["params"]))  # one line per plan
