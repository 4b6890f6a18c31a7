"""Plan and Profile JSON: round trips, schema versions, validation, fingerprints."""

from __future__ import annotations

import dataclasses

import pytest

from planner import Plan, PlanFormatError, Profile, ProfileFormatError
from search_spaces import uniform


def test_profile_round_trip(make_profile, tmp_path):
    p = make_profile(n_blocks=3)
    p.to_json(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == p


def test_plan_round_trip_keeps_lists_and_provenance(make_profile, tmp_path):
    p = make_profile(n_blocks=3)
    plan = uniform.build(p, 2, 3).with_knobs(unshard_async_op=True)
    plan = plan.with_provenance(study="s", trial=4, predicted_ms=1.5, measured_ms=2.5)
    plan.to_json(tmp_path / "plan.json")
    back = Plan.load(tmp_path / "plan.json")
    assert back == plan
    assert back.modules["b0"].forward_prefetch == ("b1", "b2")
    assert back.modules["b2"].backward_prefetch == ("b1", "b0")


def test_default_plan_is_fsdp2_default(make_profile):
    p = make_profile()
    d = Plan.default(p)
    assert all(not m.forward_prefetch and not m.backward_prefetch for m in d.modules.values())
    assert d.modules[""].reshard_after_forward is False and d.modules["b0"].reshard_after_forward is True
    assert d.unshard_async_op is False
    assert d.is_default_for(p)
    assert not uniform.build(p, 1, 1).is_default_for(p)
    assert uniform.build(p, 0, 1).is_default_for(p)  # the grid's first point


def test_behaviour_key_ignores_provenance(make_profile):
    p = make_profile()
    a = Plan.default(p)
    assert a.behaviour_key() == a.with_provenance(trial=3).behaviour_key()


def test_separate_reduce_scatter_group_round_trips_and_is_written_only_when_set(make_profile):
    p = make_profile()
    plan = Plan.default(p).with_knobs(separate_reduce_scatter_group=True)
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.behaviour_key() != Plan.default(p).behaviour_key()
    assert "separate_reduce_scatter_group" not in Plan.default(p).to_dict()  # earlier plans keep their keys


def test_the_work_outside_the_modules_round_trips_and_is_written_only_when_measured(make_profile):
    p = make_profile()
    assert "outside_ms" not in p.to_dict()  # a recorder's profile: the file earlier releases wrote
    traced = dataclasses.replace(p, outside_ms=12.5)
    assert traced.to_dict()["outside_ms"] == 12.5 and Profile.from_json(traced.to_json()) == traced


def test_a_plan_read_back_from_a_model_round_trips_its_integer_reshard_and_unknown_knobs(make_profile):
    """A plan of provenance ``user`` (``runtime.current_plan``): a module wrapped with ``reshard_after_forward=2``
    keeps its integer through JSON, and the knobs the running torch could not read are named; a plan without
    either writes neither key (earlier plans keep their bytes)."""
    from planner.artifacts.plan import ModulePlan, Source

    p = make_profile(n_blocks=3)
    plan = dataclasses.replace(Plan.default(p), modules={**Plan.default(p).modules, "b1": ModulePlan(
        reshard_after_forward=2)}).with_provenance(source=Source.USER, unknown_knobs=("unshard_in_backward",))
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.modules["b1"].reshard_after_forward == 2
    assert type(back.modules["b0"].reshard_after_forward) is bool
    assert back.provenance.source == Source.USER and back.provenance.unknown_knobs == ("unshard_in_backward",)
    assert back.behaviour_key() != Plan.default(p).behaviour_key()
    assert "unknown_knobs" not in Plan.default(p).to_dict()["provenance"]
    d = plan.to_dict()
    d["modules"]["b1"]["reshard_after_forward"] = 1  # FSDP2 reads 1 as False: a plan says False
    with pytest.raises(PlanFormatError, match="reshard_after_forward"):
        Plan.from_dict(d)


def test_the_simulator_refuses_an_integer_reshard_naming_the_module(make_profile):
    from planner.artifacts.plan import ModulePlan
    from planner.errors import UnsupportedPlanError
    from planner.simulation.parameters import simulate

    p = make_profile(n_blocks=3)
    plan = dataclasses.replace(Plan.default(p), modules={**Plan.default(p).modules, "b1": ModulePlan(
        reshard_after_forward=2)})
    with pytest.raises(UnsupportedPlanError, match="b1 reshards to 2 ranks after forward"):
        simulate(p, plan)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(schema_version=99), "schema_version 99"),
        (lambda d: d.pop("fingerprint"), "fingerprint"),
        (lambda d: d["modules"].update({"nope": d["modules"]["b0"]}), "'nope'"),
        (lambda d: d["modules"]["b0"].update(forward_prefetch=["ghost"]), "'ghost'"),
        (lambda d: d["modules"]["b0"].update(forward_prefetch="b1"), r"modules.b0.forward_prefetch must be a list"),
        (lambda d: d.update(unshard_async_op="yes"), "unshard_async_op"),
        (lambda d: d.update(separate_reduce_scatter_group=1), "separate_reduce_scatter_group"),
    ],
)
def test_plan_format_errors(make_profile, mutate, message):
    d = Plan.default(make_profile()).to_dict()
    mutate(d)
    with pytest.raises(PlanFormatError, match=message):
        Plan.from_dict(d)


def test_plan_malformed_and_truncated_json(make_profile, tmp_path):
    text = Plan.default(make_profile()).to_json()
    with pytest.raises(PlanFormatError, match="not valid JSON"):
        Plan.from_json(text[: len(text) // 2])
    with pytest.raises(PlanFormatError, match="JSON object"):
        Plan.from_json("[1, 2]")
    with pytest.raises(PlanFormatError, match="cannot read"):
        Plan.load(tmp_path / "missing.json")


def test_profile_format_errors(make_profile):
    d = make_profile().to_dict()
    with pytest.raises(ProfileFormatError, match="schema_version"):
        Profile.from_dict({**d, "schema_version": 0})
    with pytest.raises(ProfileFormatError, match="not valid JSON"):
        Profile.from_json("{")
    with pytest.raises(ProfileFormatError, match="no figures"):
        Profile.from_dict({**d, "post_forward_order": ["b0", "zz", ""]})


def test_fingerprint_first_difference(make_profile):
    fp = make_profile(n_blocks=3).fingerprint
    assert fp.first_difference(fp) is None
    assert "world size" in fp.first_difference(dataclasses.replace(fp, world_size=4))
    other = dataclasses.replace(fp, module_fqns=("", "b0", "bX", "b2"))
    assert "'b1'" in fp.first_difference(other) and "'bX'" in fp.first_difference(other)
    fewer = dataclasses.replace(fp, module_fqns=fp.module_fqns[:3], param_numels=fp.param_numels[:3])
    assert "count" in fp.first_difference(fewer)
    numel = dataclasses.replace(fp, param_numels=(100, 100, 7, 100))
    assert "parameter count of FSDP module 'b1'" in fp.first_difference(numel)
    assert fp.first_difference(dataclasses.replace(fp, torch_version="other")) is None


def test_the_default_steps_allocator_and_faults_round_trip_and_are_written_only_when_measured(make_profile):
    from planner.artifacts.profile import InStepTimings

    older = dataclasses.replace(make_profile(), in_step=InStepTimings(100.0))
    assert set(older.to_dict()["in_step"]) == {"default_step_ms", "overlap"}  # the file earlier releases wrote
    measured = dataclasses.replace(older, in_step=InStepTimings(100.0, allocator="jemalloc", default_step_faults=12,
                                                                default_step_kernel_ms=2.5))
    again = Profile.from_json(measured.to_json())
    assert again == measured and again.in_step.kernel_share() == pytest.approx(0.025)
    assert older.in_step.kernel_share() is None
    d = measured.to_dict()
    d["in_step"]["allocator"] = "tcmalloc"
    with pytest.raises(ProfileFormatError, match="in_step.allocator"):
        Profile.from_dict(d)
