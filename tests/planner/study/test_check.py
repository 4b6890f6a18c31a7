"""``prefetch-planner check`` without ranks: each known-bad pattern (``planner.study.known_bad``) flagged on a plan
built for it, none on FSDP2's default, and the priced report (``planner.study.check``)."""

from __future__ import annotations

import dataclasses

import pytest

from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.plan import ModulePlan, Plan, Source
from planner.study.check import check_plan, configuration_lines
from planner.study.known_bad import Pattern, known_bad
from planner.testing import synthetic_profile


def _with(plan: Plan, **modules: ModulePlan) -> Plan:
    return dataclasses.replace(plan, modules={**plan.modules, **modules})


def _world(profile, world_size: int):
    fp = profile.fingerprint
    return dataclasses.replace(profile, fingerprint=dataclasses.replace(fp, world_size=world_size))


def test_fsdp2s_default_matches_no_pattern():
    profile = synthetic_profile(n_blocks=4)
    assert known_bad(Plan.default(profile), profile, memory_budget_bytes=10 ** 9) == []


def test_forward_prefetch_on_modules_that_recompute_is_flagged_with_its_source_and_fix():
    profile = synthetic_profile(n_blocks=4)
    profile = dataclasses.replace(profile, modules={f: dataclasses.replace(m, recompute_ms=5.0) if f else m
                                                    for f, m in profile.modules.items()})
    plan = _with(Plan.default(profile), b0=ModulePlan(forward_prefetch=("b1", "b2")))
    (finding,) = known_bad(plan, profile)
    assert finding.pattern == Pattern.FORWARD_PREFETCH_WITH_RECOMPUTE and finding.modules == ("b0",)
    assert "AMD Primus #884" in finding.source and "checkpoint inside" in finding.fix


def test_a_checkpointed_unit_whose_forward_runs_twice_is_flagged_as_duplicated_all_gathers():
    profile = synthetic_profile(n_blocks=3)
    profile = dataclasses.replace(profile, modules={
        f: dataclasses.replace(m, recompute_ms=5.0, calls=2) if f == "b1" else m for f, m in profile.modules.items()})
    findings = known_bad(Plan.default(profile), profile)
    assert [f.pattern for f in findings] == [Pattern.DUPLICATED_ALL_GATHERS] and findings[0].modules == ("b1",)
    assert "use_reentrant=False" in findings[0].fix and "NeMo-Automodel #3373" in findings[0].source


def test_reentrant_checkpointing_is_flagged_on_every_recomputing_module():
    profile = synthetic_profile(n_blocks=3)
    profile = dataclasses.replace(profile, modules={
        f: dataclasses.replace(m, recompute_ms=5.0) if f in ("b0", "b2") else m for f, m in profile.modules.items()})
    assert known_bad(Plan.default(profile), profile) == []
    (finding,) = known_bad(Plan.default(profile), profile, reentrant=True)
    assert finding.pattern == Pattern.DUPLICATED_ALL_GATHERS and finding.modules == ("b0", "b2")


def test_an_integer_reshard_below_the_shard_group_is_flagged_with_the_memory_it_holds():
    profile = _world(synthetic_profile(n_blocks=3, unsharded_bytes=8 << 20), 8)
    plan = _with(Plan.default(profile), b1=ModulePlan(reshard_after_forward=2))
    (finding,) = known_bad(plan, profile)
    assert finding.pattern == Pattern.RESHARD_BELOW_SHARD_GROUP and finding.modules == ("b1",)
    assert "1/2 of those parameters" in finding.detail and "instead of 1/8" in finding.detail
    assert "+4.0 MiB" in finding.detail and "pytorch #147179" in finding.source


def test_prefetch_lists_at_world_size_1_are_flagged():
    profile = _world(synthetic_profile(n_blocks=3), 1)
    plan = _with(Plan.default(profile), b2=ModulePlan(backward_prefetch=("b1",)))
    (finding,) = known_bad(plan, profile)
    assert finding.pattern == Pattern.PREFETCH_AT_WORLD_SIZE_1 and "torchtitan #2749" in finding.source


def test_prefetching_a_module_outside_the_post_forward_order_is_flagged():
    """``b2`` is an FSDP module the recorded step never ran forward (an unused head): prefetching it issues an
    all-gather nothing waits for."""
    profile = synthetic_profile(n_blocks=3)
    profile = dataclasses.replace(profile, post_forward_order=("b0", "b1", ""))
    plan = _with(Plan.default(profile), b0=ModulePlan(forward_prefetch=("b1", "b2")))
    (finding,) = known_bad(plan, profile)
    assert finding.pattern == Pattern.PREFETCH_OUTSIDE_ORDER and "they prefetch b2" in finding.detail


def test_a_forward_prefetch_depth_whose_all_gathers_exceed_the_budget_is_flagged():
    profile = synthetic_profile(n_blocks=6, unsharded_bytes=100 << 20)
    deep = _with(Plan.default(profile), b0=ModulePlan(forward_prefetch=("b1", "b2", "b3")))
    (finding,) = known_bad(deep, profile, memory_budget_bytes=300 << 20)
    assert finding.pattern == Pattern.DEPTH_OVER_BUDGET and finding.modules == ("b0",)
    assert "400.0 MiB" in finding.detail
    assert known_bad(deep, profile, memory_budget_bytes=500 << 20) == []
    assert known_bad(deep, profile) == []  # no budget: nothing to check against


def test_the_check_report_prices_the_users_plan_against_fsdp2s_default_and_the_recommendation():
    """Forward prefetch with async unshard (what overlaps an all-gather on a CPU) on a profile whose all-gathers are
    exposed: the user's plan is priced faster than FSDP2's default, the difference put on exposed communication; a
    recommendation is priced beside."""
    profile = synthetic_profile(n_blocks=4, fwd=10.0, bwd=20.0, ag=8.0, rs=3.0)
    users = _with(Plan.default(profile), **{f"b{i}": ModulePlan(forward_prefetch=(f"b{i + 1}",)) for i in range(3)})
    users = users.with_knobs(unshard_async_op=True).with_provenance(source=Source.USER)
    report = check_plan(users, profile, Plan.default(profile).with_knobs(unshard_async_op=True), "trial 3")
    yours, default, recommended = report.priced
    assert (yours.label, default.label, recommended.label) == ("yours", "FSDP2 default", "trial 3")
    assert yours.step_ms < default.step_ms and yours.exposed_comm_ms < default.exposed_comm_ms
    text = "\n".join(report.lines())
    assert "b0: forward prefetch b1" in text and "as FSDP2 does by default: root, b3" in text
    assert "plan knobs: unshard_async_op = True" in text
    assert "known-bad patterns: none matched" in text
    assert (f"yours against FSDP2 default: {default.step_ms - yours.step_ms:.1f} ms faster a step (exposed "
            f"communication {yours.exposed_comm_ms - default.exposed_comm_ms:+.1f} ms), peak +0.0 MiB") in text
    d = report.to_dict()
    assert [p["label"] for p in d["priced"]] == ["yours", "FSDP2 default", "trial 3"] and d["findings"] == []


def test_a_plan_the_simulator_refuses_is_reported_unpriced_with_the_reason():
    profile = _world(synthetic_profile(n_blocks=3), 8)
    plan = _with(Plan.default(profile), b1=ModulePlan(reshard_after_forward=2))
    report = check_plan(plan, profile)
    assert report.priced[0].step_ms is None and "reshards to 2 ranks" in report.priced[0].why_not
    assert "not priced" in "\n".join(report.lines())
    assert [f.pattern for f in report.findings] == [Pattern.RESHARD_BELOW_SHARD_GROUP]


def test_a_plan_of_another_model_is_refused():
    from planner.errors import PlanMismatchError

    profile = synthetic_profile(n_blocks=3)
    other = synthetic_profile(n_blocks=4)
    with pytest.raises(PlanMismatchError):
        check_plan(Plan.default(other), profile)


def test_the_configuration_read_back_is_one_line_a_module_told_something_and_one_for_the_rest():
    profile = synthetic_profile(n_blocks=6)
    plan = _with(Plan.default(profile), b5=ModulePlan(reshard_after_forward=False),
                 b0=ModulePlan(backward_prefetch=("b1",)).with_knobs(unshard_in_backward=False))
    lines = configuration_lines(plan.with_knobs(unshard_async_op=True))
    assert "b0: backward prefetch b1; unshard_in_backward = False" in lines
    assert "b5: keeps its parameters after forward" in lines
    assert "as FSDP2 does by default: root, b1, b2, b3, ... (5 modules)" in lines
    assert lines[-1] == "plan knobs: unshard_async_op = True"
    assert isinstance(profile.fingerprint, Fingerprint)


def test_check_only_prices_the_plan_on_the_studys_stored_profile_of_this_job(tmp_path):
    """``AutoTuner(check_only=True)``'s report (``check_in_study``): priced on the study's stored profile of the same
    job; a study without one (no database, or a profile of another world size) gets the configuration and how to
    record one, and nothing is written."""
    from planner.storages.archive import save_profile
    from planner.storages.rdb import open_storage
    from planner.study.check import check_in_study
    from planner.study.in_loop import in_loop_config

    profile = synthetic_profile(n_blocks=4)
    plan = _with(Plan.default(profile), b0=ModulePlan(forward_prefetch=("b1", "b2")))
    url = f"sqlite:///{tmp_path}/s.db"
    config = in_loop_config("s", url, None)
    lines = check_in_study(config, profile.fingerprint, plan)
    assert "b0: forward prefetch b1, b2" in "\n".join(lines) and "not priced" in lines[-1]
    assert not (tmp_path / "s.db").exists()
    storage = open_storage(url)
    save_profile(storage.engine, "s", _world(profile, 8))  # another job: not this one's figures
    assert "not priced" in check_in_study(config, profile.fingerprint, plan)[-1]
    save_profile(storage.engine, "s", profile)
    storage.engine.dispose()
    priced = "\n".join(check_in_study(config, profile.fingerprint, plan))
    assert "yours against FSDP2 default" in priced and "not priced" not in priced


def test_check_and_simulate_give_one_answer_for_one_profile_and_plan():
    """``check`` prices a plan as ``simulate PROFILE PLAN`` does (``Scenario.price``): the same step, exposed
    communication and peak for the hand-set plan and for FSDP2's default, on the committed 2-rank Llama profile."""
    import json
    from pathlib import Path

    from click.testing import CliRunner

    from planner.artifacts.profile import Profile
    from planner.presentation.cli import main

    captured = Path(__file__).parents[3] / "docs" / "captured"
    profile_json = captured / "llama-cpu-hand-set.profile.json"
    plan_json = captured / "llama-cpu-hand-set.own.plan.json"
    profile = Profile.load(profile_json)
    assert profile.fingerprint.world_size == 2
    yours, default = check_plan(Plan.load(plan_json), profile).priced
    for priced, args in ((yours, [str(profile_json), str(plan_json)]), (default, [str(profile_json)])):
        result = CliRunner().invoke(main, ["simulate", *args, "--json"], catch_exceptions=False)
        simulated = json.loads(result.stdout)
        assert (priced.step_ms, priced.exposed_comm_ms, priced.peak_bytes) == (
            simulated["step_ms"], simulated["exposed_comm_ms"], simulated["peak_bytes"])
    assert yours.step_ms != default.step_ms
