"""The memory budget: parsing, resolving, the infeasible case, candidates and measured trials within it, the front."""

from __future__ import annotations

import dataclasses

import optuna
import pytest
from click.testing import CliRunner

from planner.artifacts.memory_budget import MemoryBudget, check_feasible
from planner.artifacts.plan import Plan
from planner.errors import FailKind, MemoryBudgetError, StudyConfigError
from planner.presentation.cli import main
from planner.simulation.parameters import simulator_for
from planner.storages import open_storage
from planner.study import MeasuredStage, pareto_front, smallest_peak, study_trials
from planner.study.earlier_jobs import EarlierJobs
from planner.study.records import PEAK_OVER_BUDGET, SimulatedTrialRecord
from planner.study.session import TuningSession
from planner.testing import drive_round, study_config
from search_spaces import get_space

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
    least = smallest_peak(simulator_for(profile), get_space("assign"))
    check_feasible(least, least, "x")  # exactly enough is enough
    with pytest.raises(MemoryBudgetError) as info:
        check_feasible(least - 1, least, "1GiB")
    assert f"{least / MIB:.1f} MiB" in str(info.value) and "\n" not in str(info.value)


def test_candidates_fit_the_budget_and_over_budget_trials_fail(make_profile, tmp_path):
    """Only plans predicted within the budget are raced; a measured peak over it fails the trial (not retried)."""
    # all-gathers (30 ms) longer than compute: keeping blocks unsharded after forward saves time, at a memory cost
    profile = dataclasses.replace(make_profile(n_blocks=4, fwd=10.0, bwd=20.0, ag=30.0, rs=3.0,
                                               unsharded_bytes=100 * MIB), measured_peak_bytes=0)
    budget = smallest_peak(simulator_for(profile), get_space("assign")) + 100 * MIB  # room for one block more
    config = study_config(tmp_path, name="b", space="assign", sim_trials=80, measured_trials=2,
                          memory_budget=f"{budget}B")
    session = TuningSession(config, profile, get_space("assign"), job="test", plan_out=str(tmp_path / "plan.json"),
                            profile_out=str(tmp_path / "profile.json"))
    asked, outcome = drive_round(session, [100.0, 90.0, 95.0], peak_bytes=[budget + 1, budget + 1, budget])
    assert session.budget.limit_bytes == budget
    trials = study_trials(config.storage_url, "b")
    assert any(t.predicted_peak_bytes > budget for t in trials.simulated)  # the search saw plans over it ...
    assert all(a.candidate.predicted_peak_bytes <= budget for a in asked[1:])  # ... none is raced
    sim = optuna.load_study(study_name="b.sim", storage=config.storage_url)
    assert sum(f"constraints:{PEAK_OVER_BUDGET}" in t.system_attrs for t in sim.trials) == 80  # Optuna's constraint
    # the default is the baseline: never failed; the candidate over the budget is FAIL, not measured again
    assert outcome.failed == {asked[1].number: outcome.failed[asked[1].number]}
    assert "exceeds the memory budget" in outcome.failed[asked[1].number]
    assert [p.provenance.trial for p in outcome.plans_measured] == [asked[0].number, asked[2].number]
    assert [p.provenance.measured_peak_bytes for p in outcome.plans_measured] == [budget + 1, budget]
    assert all(p.provenance.memory_budget_bytes == budget for p in outcome.plans_measured)
    failed = next(t for t in trials.measured if t.number == asked[1].number)
    assert failed.state.name == "FAIL" and failed.measured_peak_bytes == budget + 1
    assert failed.failure.kind == FailKind.ERROR
    stage = MeasuredStage(config, open_storage(config.storage_url, config), simulator_for(profile), "next",
                          get_space("assign"))
    assert failed.plan_key in EarlierJobs(stage).settled_keys()
    stage.close()


def test_pareto_front_and_command(make_profile, tmp_path):
    points = [SimulatedTrialRecord(number=n, predicted_ms=ms, predicted_peak_bytes=peak)
              for n, (ms, peak) in enumerate([(10, 5), (8, 6), (9, 7), (8, 6), (7, 9), (11, 4)])]
    assert [t.number for t in pareto_front(points + [SimulatedTrialRecord(number=9)])] == [5, 0, 1, 4]

    profile = make_profile(n_blocks=4, fwd=10.0, bwd=20.0, ag=8.0, rs=3.0, unsharded_bytes=100 * MIB)
    config = study_config(tmp_path, name="p", space="assign", sim_trials=60, measured_trials=1)
    session = TuningSession(config, profile, get_space("assign"), job="test", plan_out=str(tmp_path / "plan.json"),
                            profile_out=str(tmp_path / "profile.json"))
    drive_round(session, [100.0, 90.0], peak_bytes=[300 * MIB, 400 * MIB])
    png = tmp_path / "front.png"
    result = CliRunner().invoke(main, ["studies", "pareto", "p", "--storage", config.storage_url, "--png", str(png)])
    assert result.exit_code == 0, result.output
    front = pareto_front(study_trials(config.storage_url, "p").simulated)
    assert f"{len(front)} plans of 60 simulated trials" in result.output
    assert "400.0" in result.output and "FSDP2 default" in result.output
    assert png.stat().st_size > 10_000


def test_a_cuda_devices_default_budget_is_what_the_process_can_reach_less_the_margin():
    """``device_budget``: reserved plus free, less 10% of the device; a device already full gives a budget of zero,
    which keeps FSDP2's default (every pass and candidate is over it) rather than stopping the job."""
    from planner.artifacts.memory_budget import DEVICE_MARGIN, device_budget

    gib = 2 ** 30
    budget = device_budget(free_bytes=60 * gib, reserved_bytes=12 * gib, total_bytes=80 * gib)
    assert DEVICE_MARGIN == 0.10 and budget.resolve(None) == 64 * gib
    assert MemoryBudget.parse(budget.text).resolve(None) == 64 * gib  # its text is a budget as a user writes one
    assert device_budget(free_bytes=2 * gib, reserved_bytes=75 * gib, total_bytes=80 * gib).resolve(None) == 69 * gib
    assert device_budget(free_bytes=1 * gib, reserved_bytes=0, total_bytes=80 * gib).resolve(None) == 0


def test_the_process_memory_fraction_caps_the_cuda_default():
    """``torch.cuda.set_per_process_memory_fraction`` holds the allocator to a share of the device: the default
    budget is at most that share, less the margin."""
    from planner.artifacts.memory_budget import device_budget

    gib = 2 ** 30
    assert device_budget(free_bytes=60 * gib, reserved_bytes=12 * gib, total_bytes=80 * gib,
                         fraction=0.5).resolve(None) == 32 * gib  # 40 GiB, less 8


def test_a_candidate_is_charged_the_baselines_error_and_nccls_buffers(make_profile, tmp_path):
    """``PeakBudget``: a predicted peak is charged the simulator's error on the job's baseline and, per NCCL
    communicator the plan adds, the stated allowance; a measured peak (the caching allocator's) the allowance alone.
    ``job_budget`` sets the error from the profile's measured default peak, and the allowance on CUDA only."""
    from planner.artifacts.memory_budget import NCCL_COMMUNICATOR_BYTES, PeakBudget
    from planner.study.budget import job_budget
    from search_spaces import uniform

    p = make_profile(n_blocks=4)
    default, separate = Plan.default(p), uniform.build(p, 1, 1).with_knobs(separate_reduce_scatter_group=True)
    budget = PeakBudget(100, error_bytes=10, communicator_bytes=30)
    assert (budget.charged(default, 50), budget.charged(separate, 50)) == (60, 90)
    assert budget.charged(separate, 50, predicted=False) == 80 and not budget.admits(separate, 71)
    assert NCCL_COMMUNICATOR_BYTES == 512 * MIB
    simulator = simulator_for(p)
    predicted = simulator.run(default).peak_bytes
    measured = dataclasses.replace(p, measured_peak_bytes=predicted + 700)
    config = study_config(tmp_path, memory_budget="+100%")
    cpu = job_budget(config, measured, simulator_for(measured), get_space("assign"))
    assert (cpu.error_bytes, cpu.communicator_bytes) == (700, 0)
    under = dataclasses.replace(p, measured_peak_bytes=predicted - 700)  # over-predicted: nothing charged
    assert job_budget(config, under, simulator_for(under), get_space("assign")).error_bytes == 0
    cuda = dataclasses.replace(measured, fingerprint=dataclasses.replace(measured.fingerprint, device_type="cuda"))
    assert job_budget(config, cuda, simulator_for(cuda), get_space("assign")).communicator_bytes == \
        NCCL_COMMUNICATOR_BYTES
    assert job_budget(study_config(tmp_path), measured, simulator, get_space("assign")) is None


def test_the_error_charge_reads_the_highest_of_the_defaults_peak_steps(tmp_path):
    """A profile whose peak steps read one block more in one step (as the reference Llama's do): the charge is set
    by that step, not by the median the profile keeps."""
    from pathlib import Path

    from planner.artifacts.profile import Profile
    from planner.study.budget import highest_default_peak, job_budget

    p = Profile.load(Path(__file__).parents[3] / "docs" / "captured" / "llama-cpu-hand-set.profile.json")
    low, high = 1189035528, 1240423944
    ranks = [dataclasses.replace(r, steps=dataclasses.replace(r.steps, peak_bytes=(low, low, high if i else low)))
             for i, r in enumerate(p.per_rank)]
    p = dataclasses.replace(p, per_rank=ranks, measured_peak_bytes=low)
    assert highest_default_peak(p) == high
    assert highest_default_peak(dataclasses.replace(p, per_rank=[])) == low
    simulator = simulator_for(p)
    predicted = simulator.run(Plan.default(p)).peak_bytes
    budget = job_budget(study_config(tmp_path, memory_budget="+100%"), p, simulator, get_space("assign"))
    assert budget.error_bytes == high - predicted > low - predicted
