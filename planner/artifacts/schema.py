"""How the artifacts' JSON is validated: strictly, against the artifacts' own declarations.

Every plan and profile file is read and written through pydantic: a field of
the wrong type (``"false"`` where a bool belongs, ``"3"`` where a number does),
a missing field or an unknown one is refused with one line that names the
field (:func:`describe`), instead of being coerced. The frozen dataclasses are
validated themselves (each carries :data:`STRICT`, ``pydantic.with_config``);
a file's layout where it differs from the dataclass (a plan's knobs written
flat, a profile's modules as a list, a rank's figures flat) is declared once,
beside its dataclass (``PlanDocument`` in ``planner.artifacts.plan``,
``ProfileDocument`` in ``planner.artifacts.profile``, ``RankMeasurementsDocument``
in ``planner.artifacts.rank_measurements``). Optional fields that later releases
added have defaults, so files written before them read as they always did;
``schema_version`` stays 1.
"""

from __future__ import annotations

import json
from typing import Annotated, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from planner.artifacts.json_types import JsonObject
from planner.artifacts.knobs import Knob, Written

SCHEMA_VERSION = 1


STRICT = ConfigDict(strict=True, extra="forbid")
"""The artifacts' validation: strict types, no unknown keys (a dataclass's ``pydantic.with_config``)."""


class Document(BaseModel):
    """A JSON object of an artifact whose layout is not its dataclass's: strict types, no unknown keys."""

    model_config = STRICT


def _bool_or_ranks(value: object) -> bool | int:
    """``reshard_after_forward``: a bool, or the ranks a module reshards to after forward (an integer of 2 or more:
    FSDP2 reads 1 as ``False`` and the shard group's size as ``True``)."""
    if isinstance(value, bool) or type(value) is int and value >= 2:
        return value
    raise PydanticCustomError("bool_or_ranks", "must be true or false, or the ranks it reshards to (an integer of 2 "
                                               "or more)")


ReshardAfterForward = Annotated[bool | int, PlainValidator(_bool_or_ranks)]
"""``reshard_after_forward`` as a plan writes it: a bool, or an integer of 2 or more."""


def knob_fields(knobs: tuple[Knob, ...]) -> dict[str, tuple[type, FieldInfo]]:
    """The pydantic fields of ``knobs``: each typed as its default, required or defaulted as it is written."""
    return {k.name: (k.kind, Field(... if k.written is Written.REQUIRED else k.default, ge=k.minimum))
            for k in knobs}


_PROBLEMS = {
    "bool_type": "must be true or false",
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "tuple_type": "must be a list",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "dataclass_type": "must be an object",
    "missing": "is missing",
    "missing_argument": "is missing",
    "extra_forbidden": "is not a field of this schema (a typo, or a field of a newer prefetch-planner)",
    "unexpected_keyword_argument": "is not a field of this schema (a typo, or a field of a newer prefetch-planner)",
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
    found = "" if first["type"] in ("missing", "missing_argument") else f", found {first['input']!r}"
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
