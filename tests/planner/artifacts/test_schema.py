"""Plan and Profile JSON through their strict schema: what the project ships loads, bad fields are named."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from planner.artifacts.plan import Plan
from planner.artifacts.profile import Profile
from planner.errors import PlanFormatError, ProfileFormatError

ROOT = Path(__file__).parents[3]
RELEASE_0_1_0 = ROOT / "tests" / "data" / "release-0.1.0"
# One profile or plan of every structure that release 0.1's bench runs wrote (each key set and value type seen),
# kept when those raw runs left the tree: {"kind", "from" (the run it came from), "document"}.
SHIPPED_0_1 = ROOT / "tests" / "data" / "shipped-0.1" / "documents.json.gz"


def _shipped_documents() -> list[tuple[str, str, dict]]:
    """Every profile and plan JSON object the project ships (test data, and the documents of release 0.1's runs)."""
    found = [(d["kind"], d["from"], d["document"]) for d in json.loads(gzip.decompress(SHIPPED_0_1.read_bytes()))]

    def walk(x, where: str) -> None:
        if isinstance(x, dict):
            if x.get("schema_version") is not None and "pre_forward_order" in x:
                found.append(("profile", where, x))
            elif x.get("schema_version") is not None and "modules" in x and "fingerprint" in x:
                found.append(("plan", where, x))
            for k, v in x.items():
                walk(v, f"{where}.{k}")
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, f"{where}[{i}]")

    for path in sorted((ROOT / "tests" / "data").rglob("*.json")):
        walk(json.loads(path.read_text()), str(path.relative_to(ROOT)))
    return found


def _within(a, b) -> bool:
    """Every key of ``a`` (recursively) is in ``b`` with the same value, but for a later field left out because it
    holds its default, 0 or null (``rank_measurements.RankMeasurements.to_json`` writes those only where set)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and all(
            _within(v, b[k]) if k in b else (v is None or (type(v) in (int, float) and v == 0)) for k, v in a.items())
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_within, a, b))
    return a == b or (a != a and b != b)  # NaN is NaN


def test_every_profile_and_plan_the_project_ships_loads():
    documents = _shipped_documents()
    kinds = {kind for kind, _, _ in documents}
    assert kinds == {"profile", "plan"} and len(documents) > 40  # the walk finds them
    for kind, where, d in documents:
        artifact = Profile if kind == "profile" else Plan
        loaded = artifact.from_dict(d)
        written = json.loads(loaded.to_json())
        assert _within(d, written), where  # everything it said is written back (with defaults for later fields)
        assert artifact.from_dict(written).to_json() == loaded.to_json(), where


def test_files_the_previous_release_wrote_read_and_write_back_byte_for_byte():
    for name, artifact in (("llama-cpu.profile.json", Profile), ("llama-cpu.plan.json", Plan)):
        text = (RELEASE_0_1_0 / name).read_text()
        assert artifact.from_json(text).to_json() == text
    plan = Plan.load(RELEASE_0_1_0 / "llama-cpu.plan.json")
    plan.check_matches(Profile.load(RELEASE_0_1_0 / "llama-cpu.profile.json"))
    assert plan.provenance.verdict == "faster" and plan.unshard_async_op


def test_files_this_version_wrote_read_and_write_back_byte_for_byte():
    """The profiles and plans the docs capture, written by this version with the later fields set (a rank's async
    ratio, faults and allocator after its calls): every field read back from its declaration and written in the
    file's order."""
    captured = sorted((ROOT / "docs" / "captured").glob("*.json"))
    profiles = [p for p in captured if p.name.endswith(".profile.json")]
    assert profiles and any('"allocator"' in p.read_text() for p in profiles)
    for path in captured:
        text = path.read_text()
        artifact = Profile if path.name.endswith(".profile.json") else Plan if path.name.endswith(".plan.json") \
            else None
        if artifact is not None:
            assert artifact.from_json(text).to_json() == text.rstrip("\n"), path.name


def _plan_dict() -> dict:
    return json.loads((RELEASE_0_1_0 / "llama-cpu.plan.json").read_text())


def _profile_dict() -> dict:
    return json.loads((RELEASE_0_1_0 / "llama-cpu.profile.json").read_text())


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d["modules"]["model.layers.0"].update(reshard_after_forward="false"),
     "plan field modules['model.layers.0'].reshard_after_forward must be true or false, or the ranks it reshards "
     "to (an integer of 2 or more), found 'false'"),
    (lambda d: d.update(reshard_after_backward="false"),
     "plan field reshard_after_backward must be true or false, found 'false'"),
    (lambda d: d.update(reduce_scatter_max_input_buffers="2"),
     "plan field reduce_scatter_max_input_buffers must be an integer, found '2'"),
    (lambda d: d.update(reduce_scatter_max_input_buffers=0),
     "plan field reduce_scatter_max_input_buffers input should be greater than or equal to 1, found 0"),
    (lambda d: d["modules"][""].update(reshard_afterforward=True),
     "plan field modules[''].reshard_afterforward is not a field of this schema"),
    (lambda d: d["fingerprint"].pop("world_size"), "plan field fingerprint.world_size is missing"),
    (lambda d: d["provenance"].update(source="guessed"),
     "plan field provenance.source input should be 'default', 'measured', 'predicted' or 'user'"),
])
def test_a_plan_field_of_the_wrong_kind_is_named_not_coerced(mutate, message):
    d = _plan_dict()
    mutate(d)
    with pytest.raises(PlanFormatError) as info:
        Plan.from_json(json.dumps(d))
    assert str(info.value).startswith(message), str(info.value)
    assert "studies export" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d["modules"][1].update(needs_parameters_in_backward="no"),
     "profile field modules[1].needs_parameters_in_backward must be true or false, found 'no'"),
    (lambda d: d.update(microbatches=0), "profile field microbatches input should be greater than or equal to 1"),
    (lambda d: d["in_step"]["overlap"].pop("compute_ms"), "profile field in_step.overlap.compute_ms is missing"),
    (lambda d: d.update(optimizer_ms="fast"), "profile field optimizer_ms must be a number, found 'fast'"),
    (lambda d: d.update(outside_ms=-1.0), "profile field outside_ms input should be greater than or equal to 0"),
])
def test_a_profile_field_of_the_wrong_kind_is_named(mutate, message):
    d = _profile_dict()
    mutate(d)
    with pytest.raises(ProfileFormatError) as info:
        Profile.from_json(json.dumps(d))
    assert str(info.value).startswith(message), str(info.value)


def test_nothing_is_written_that_would_not_read_back(make_profile):
    import dataclasses

    from planner.artifacts.plan import Provenance

    plan = Plan.default(make_profile())
    broken = dataclasses.replace(plan, provenance=Provenance(rounds="3"))
    with pytest.raises(PlanFormatError, match="cannot write this plan: plan field provenance.rounds must be an int"):
        broken.to_json()
    with pytest.raises(PlanFormatError, match="unshard_async_op must be true or false, found 'yes'"):
        plan.with_knobs(unshard_async_op="yes")


def test_a_ranks_module_figures_are_read_through_the_measurements_own_declaration():
    """A module's flat document is made from :class:`ComputeMeasurements` and :class:`CollectiveMeasurements`: a field
    added there is read and written with no second declaration; release 0.1.0's fields come first and are required
    (but those older profiles lack)."""
    import dataclasses

    from planner.artifacts.rank_measurements import (
        READ_WITH_DEFAULT,
        RELEASE_MODULE_FIELDS,
        CollectiveMeasurements,
        ComputeMeasurements,
        ModuleMeasurementsDocument,
    )

    declared = [f.name for part in (ComputeMeasurements, CollectiveMeasurements) for f in dataclasses.fields(part)]
    fields = ModuleMeasurementsDocument.model_fields
    assert sorted(fields) == sorted(declared)
    assert list(fields)[:len(RELEASE_MODULE_FIELDS)] == list(RELEASE_MODULE_FIELDS)
    assert {name for name, f in fields.items() if f.is_required()} == set(RELEASE_MODULE_FIELDS) - READ_WITH_DEFAULT
    row = {name: 1 for name in RELEASE_MODULE_FIELDS} | {"needs_parameters_in_backward": True}
    with pytest.raises(ValueError, match="fwd_ms"):
        ModuleMeasurementsDocument.model_validate({**row, "fwd_ms": "1"})  # strict: no string read as a number
    with pytest.raises(ValueError, match="extra"):
        ModuleMeasurementsDocument.model_validate({**row, "fwd_msec": 1.0})


def test_a_profile_and_a_ranks_figures_are_read_through_their_dataclasses_declarations():
    """The Profile file's document and a rank's flat one are made from :class:`Profile`'s, :class:`StepMeasurements`'
    and :class:`IsolatedMeasurements`' declarations: the same fields, each with its declared bounds (no second list
    to keep in step); release 0.1.0's rank fields first, in its order."""
    import dataclasses

    from planner.artifacts.profile import ProfileDocument
    from planner.artifacts.rank_measurements import (
        FIRST_RANK_FIELDS,
        IsolatedMeasurements,
        RankMeasurementsDocument,
        StepMeasurements,
    )

    assert list(ProfileDocument.model_fields) == [f.name for f in dataclasses.fields(Profile)]
    declared = {f.name for part in (StepMeasurements, IsolatedMeasurements) for f in dataclasses.fields(part)}
    assert set(RankMeasurementsDocument.model_fields) == declared | {"rank"}
    assert list(RankMeasurementsDocument.model_fields)[:len(FIRST_RANK_FIELDS)] == list(FIRST_RANK_FIELDS)
    profile = _profile_dict()
    for key, value in (("microbatches", 0), ("outside_ms", -1.0), ("source", "guess")):
        with pytest.raises(ProfileFormatError, match=f"profile field {key} "):
            Profile.from_json(json.dumps({**profile, key: value}))
