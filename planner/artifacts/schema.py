"""The JSON documents of the artifacts (Plan and Profile JSON) as strict pydantic models.

Every plan and profile file is read and written through these models: a
field of the wrong type (``"false"`` where a bool belongs, ``"3"`` where a
number does), a missing field or an unknown one is refused with one line that
names the field (:func:`describe`), instead of being coerced. Optional fields
that later releases added have defaults, so files written before them read
as they always did; ``schema_version`` stays 1.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError, create_model
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from planner.artifacts.json_types import JsonObject
from planner.artifacts.knobs import MODULE_KNOBS, PLAN_KNOBS, Knob, Written

SCHEMA_VERSION = 1


class Document(BaseModel):
    """A JSON object of an artifact: strict types, no unknown keys."""

    model_config = ConfigDict(strict=True, extra="forbid")


class FingerprintDocument(Document):
    """``fingerprint`` (:class:`planner.artifacts.fingerprint.Fingerprint`)."""

    module_fqns: tuple[str, ...]
    param_numels: tuple[int, ...]
    param_bytes: tuple[int, ...]
    world_size: int
    device_type: str
    param_dtypes: tuple[str, ...]
    torch_version: str
    mesh: tuple[int, int] | None = None
    mixed_precision: tuple[str, str] | None = None


def _bool_or_ranks(value: object) -> bool | int:
    """``reshard_after_forward``: a bool, or the ranks a module reshards to after forward (an integer of 2 or more:
    FSDP2 reads 1 as ``False`` and the shard group's size as ``True``)."""
    if isinstance(value, bool) or type(value) is int and value >= 2:
        return value
    raise PydanticCustomError("bool_or_ranks", "must be true or false, or the ranks it reshards to (an integer of 2 "
                                               "or more)")


ReshardAfterForward = Annotated[bool | int, PlainValidator(_bool_or_ranks)]


def _knob_fields(knobs: tuple[Knob, ...]) -> dict[str, tuple[type, FieldInfo]]:
    """The pydantic fields of ``knobs``: each typed as its default, required or defaulted as it is written."""
    return {k.name: (k.kind, Field(... if k.written is Written.REQUIRED else k.default, ge=k.minimum))
            for k in knobs}


class _ModulePlanStructure(Document):
    forward_prefetch: tuple[str, ...]
    backward_prefetch: tuple[str, ...]
    reshard_after_forward: ReshardAfterForward


ModulePlanDocument = create_model("ModulePlanDocument", __base__=_ModulePlanStructure,
                                  __doc__="One module of a plan (:class:`planner.artifacts.plan.ModulePlan`) and "
                                          "its ``MODULE_KNOBS`` (``planner.artifacts.knobs``).",
                                  **_knob_fields(MODULE_KNOBS))


class ProvenanceDocument(Document):
    """``provenance`` (:class:`planner.artifacts.plan.Provenance`)."""

    source: Literal["default", "measured", "predicted", "user"] = "default"
    study: str | None = None
    trial: int | None = None
    predicted_ms: float | None = None
    measured_ms: float | None = None
    default_measured_ms: float | None = None
    verdict: str | None = None
    measured_ratio: float | None = None
    ratio_ci95: tuple[float, float] | None = None
    rounds: int | None = None
    launches: int | None = None
    noise_pct: float | None = None
    predicted_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    memory_budget_bytes: int | None = None
    ratio_of: Literal["total time"] | None = None
    target: str | None = None
    band_ms: tuple[float, float] | None = None
    params: dict[str, bool | int | float | str | None] | None = None
    unknown_knobs: tuple[str, ...] | None = None
    baseline: Literal["user"] | None = None


class _PlanStructure(Document):
    schema_version: Literal[1]
    fingerprint: FingerprintDocument
    modules: dict[str, ModulePlanDocument]  # type: ignore[valid-type]
    provenance: ProvenanceDocument = Field(default_factory=ProvenanceDocument)


PlanDocument = create_model("PlanDocument", __base__=_PlanStructure,
                            __doc__="A Plan JSON file (:class:`planner.artifacts.plan.Plan`): its structure and its "
                                    "``PLAN_KNOBS`` (``planner.artifacts.knobs``), each written as declared.",
                            **_knob_fields(PLAN_KNOBS))


class ModuleProfileDocument(Document):
    """One module of a profile (:class:`planner.artifacts.profile.ModuleProfile`)."""

    fqn: str
    fwd_ms: float
    bwd_ms: float
    fwd_pre_ms: float
    bwd_pre_ms: float
    all_gather_ms: float
    reduce_scatter_ms: float
    unsharded_bytes: int
    sharded_bytes: int
    grad_bytes: int
    activation_bytes: int
    reshard_after_forward: bool
    calls: int = Field(1, ge=1)
    needs_parameters_in_backward: bool = True
    recompute_ms: float = Field(0.0, ge=0)
    recompute_activation_bytes: int = Field(0, ge=0)
    backward_temp_bytes: int = Field(0, ge=0)
    backward_post_grad_bytes: int = Field(0, ge=0)
    activation_post_bytes: int = Field(0, ge=0)
    parameter_rows: tuple[tuple[int, int], ...] = ()


class OverlapDocument(Document):
    """``in_step.overlap`` (:class:`planner.artifacts.profile.OverlapTimings`)."""

    module: str
    all_gather_ms: float
    compute_ms: float
    overlapped_ms: float


class ModuleMeasurementsDocument(Document):
    """One module of a rank's measurements (:class:`planner.artifacts.rank_measurements.ModuleMeasurements`); the
    fields release 0.1.0 wrote first, in its order, then the later ones (written only where not 0 or null)."""

    fwd_ms: float
    bwd_ms: float
    fwd_pre_ms: float
    bwd_pre_ms: float
    all_gather_ms: float
    reduce_scatter_ms: float
    sharded_bytes: int
    activation_bytes: int
    needs_parameters_in_backward: bool = True
    recompute_ms: float = 0.0
    recompute_activation_bytes: int = 0
    backward_peak_bytes: int = 0
    grad_pre_bytes: int | None = None
    activation_post_bytes: int | None = None


class RankMeasurementsDocument(Document):
    """One rank's measurements in ``per_rank`` (:class:`planner.artifacts.rank_measurements.RankMeasurements`),
    flat; the fields release 0.1.0 wrote first, in its order, then the later ones (written only where set)."""

    rank: int
    step_ms: float
    optimizer_ms: float
    peak_bytes: list[int] | None
    optimizer_temp_bytes: int = 0
    overlap: OverlapDocument | None = None
    optimizer_state_bytes: int = 0
    pre_forward_order: tuple[str, ...]
    post_forward_order: tuple[str, ...]
    modules: dict[str, ModuleMeasurementsDocument]
    calls: dict[str, int] = Field(default_factory=dict)
    async_ratio: float | None = None
    step_faults: int | None = None
    step_kernel_ms: float | None = None
    allocator: str | None = None


class InStepDocument(Document):
    """``in_step`` (:class:`planner.artifacts.profile.InStepTimings`)."""

    default_step_ms: float
    overlap: OverlapDocument | None = None
    async_default_step_ms: float | None = Field(None, gt=0)
    allocator: Literal["system", "jemalloc"] | None = None
    default_step_faults: int | None = Field(None, ge=0)
    default_step_kernel_ms: float | None = Field(None, ge=0)


class ProfileDocument(Document):
    """A Profile JSON file (:class:`planner.artifacts.profile.Profile`); ``per_rank`` is every rank's figures before
    consolidation."""

    schema_version: Literal[1]
    fingerprint: FingerprintDocument
    pre_forward_order: tuple[str, ...]
    post_forward_order: tuple[str, ...]
    modules: list[ModuleProfileDocument]
    optimizer_ms: float
    optimizer_state_bytes: int = 0
    optimizer_temp_bytes: int = 0
    measured_step_ms: float | None = None
    measured_peak_bytes: int | None = None
    per_rank: list[RankMeasurementsDocument] = Field(default_factory=list)
    consolidation: str = "max"
    microbatches: int = Field(1, ge=1)
    calibration: dict[str, float] | None = None
    in_step: InStepDocument | None = None
    source: Literal["recorder", "trace"] = "recorder"
    estimated: tuple[str, ...] = ()
    outside_ms: float = Field(0.0, ge=0)
    post_optimizer_ms: float = Field(0.0, ge=0)


_PROBLEMS = {
    "bool_type": "must be true or false",
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "tuple_type": "must be a list",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "missing": "is missing",
    "extra_forbidden": "is not a field of this schema (a typo, or a field of a newer prefetch-planner)",
}


def describe(error: ValidationError, what: str) -> str:
    """The first problem of ``error`` as ``<what> field <path> <problem>, found <value>``.

    The path reads as Python would: ``modules['model.layers.0'].reshard_after_forward``.
    """
    first = error.errors()[0]
    path = ""
    for part in first["loc"]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif path and not str(part).isidentifier():
            path += f"[{part!r}]"
        else:
            path += f".{part}" if path else str(part)
    problem = _PROBLEMS.get(first["type"], first["msg"][:1].lower() + first["msg"][1:])
    found = "" if first["type"] == "missing" else f", found {first['input']!r}"
    return f"{what} field {path or '(top level)'} {problem}{found}"


D = TypeVar("D", bound=BaseModel)


def dump_checked(document: type[BaseModel], data: JsonObject, error: type[Exception], what: str) -> str:
    """``data`` as JSON text (indent 1), checked against ``document`` first: what could not be read back is never
    written.

    Raises:
        error: ``data`` does not fit ``document`` (the field named).
    """
    text = json.dumps(data, indent=1)
    try:
        document.model_validate_json(text)
    except ValidationError as e:
        raise error(f"cannot write this {what}: {describe(e, what)}") from None
    return text


def load_checked(document: type[D], text: str, error: type[Exception], what: str, version: int,
                 fixes: tuple[str, str, str]) -> D:
    """Parse ``text`` strictly as ``document``, after checking it is a JSON object of schema ``version``.

    Args:
        what: the artifact's name in messages (``"plan"``, ``"profile"``).
        fixes: what the user should do when the text is not JSON, of another schema version, or ill-typed.

    Raises:
        error: one line naming the problem and ``fixes``' answer.
    """
    not_json, other_version, ill_typed = fixes
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{what} is not valid JSON ({e}); {not_json}") from None
    if not isinstance(d, dict):
        raise error(f"{what} must be a JSON object, found {type(d).__name__}")
    found = d.get("schema_version")
    if found != version:
        raise error(f"unknown {what} schema_version {found!r} (this planner reads {version}); {other_version}")
    try:
        return document.model_validate_json(text)
    except ValidationError as e:
        raise error(f"{describe(e, what)}; {ill_typed}") from None
