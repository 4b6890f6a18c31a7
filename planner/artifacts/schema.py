"""How the artifacts' JSON is validated: strictly, against the artifacts' own declarations.

Every plan and profile file is read and written through pydantic: a field of
the wrong type (``"false"`` where a bool belongs, ``"3"`` where a number does),
a missing field or an unknown one is refused with one line that names the
field (:func:`describe`), instead of being coerced. The frozen dataclasses are
validated themselves (each carries :data:`STRICT`, ``pydantic.with_config``);
a file's document is made from its dataclasses' declarations (:func:`document_of`),
with only where its layout differs written beside it (a plan's knobs written
flat, a profile's modules as a list, a rank's figures flat: ``PlanDocument`` in
``planner.artifacts.plan``, ``ProfileDocument`` in ``planner.artifacts.profile``,
``RankMeasurementsDocument`` in ``planner.artifacts.rank_measurements``), and a
file is written and read through one helper (:class:`JsonFile`). Optional
fields that later releases added have defaults, so files written before them
read as they always did; ``schema_version`` stays 1.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, TypeVar

import pydantic
from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from planner.artifacts.json_types import JsonObject
from planner.artifacts.knobs import Knob, Written
from planner.errors import PlannerError

SCHEMA_VERSION = 1


STRICT = ConfigDict(strict=True, extra="forbid")
"""The artifacts' validation: strict types, no unknown keys (a dataclass's ``pydantic.with_config``)."""


class Document(BaseModel):
    """A JSON object of an artifact whose layout is not its dataclass's: strict types, no unknown keys."""

    model_config = STRICT


def document_of(name: str, doc: str, parts: Sequence[type], module: str, first: Sequence[str] = (),
                read_with_default: Collection[str] = (),
                layout: Mapping[str, tuple[object, FieldInfo]] | None = None) -> type[Document]:
    """A strict :class:`Document` of one JSON object, made from the dataclasses ``parts``' own declarations, so a
    field added to a dataclass is read and written with no second declaration.

    Each field is typed (``Annotated`` bounds kept) and defaulted as its dataclass declares it, in declaration order
    after ``first``: the fields release 0.1.0 wrote, in its order, required but for ``read_with_default`` (those
    older files lack).

    Args:
        name, doc, module: the document's class name, docstring and module.
        layout: per field, its ``(type, pydantic.Field(...))`` where the file's layout differs from the dataclass (a
            profile's modules as a list, a rank's figures as a flat document), or a field no dataclass has
            (``Field()``: required).
    """
    fields: dict[str, tuple[object, FieldInfo]] = {}
    for part in parts:
        types = typing.get_type_hints(part, include_extras=True)
        for f in dataclasses.fields(part):
            fields[f.name] = (types[f.name], Field(f.default) if f.default is not dataclasses.MISSING
                              else Field(default_factory=f.default_factory)
                              if f.default_factory is not dataclasses.MISSING else Field())
    fields.update(layout or {})
    for key in first:
        if key not in read_with_default:
            fields[key] = (fields[key][0], Field())
    order = [*first, *(key for key in fields if key not in first)]
    return pydantic.create_model(name, __base__=Document, __module__=module, __doc__=doc,
                                 **{key: fields[key] for key in order})


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


class JsonFile:
    """What every artifact written as a JSON file shares (:class:`planner.artifacts.plan.Plan`,
    :class:`planner.artifacts.profile.Profile`): written only after it is checked against its document, read
    strictly from JSON text, a parsed object or a path.

    A subclass sets :attr:`WHAT` (its name in messages) and :attr:`ERROR` (what it raises), and defines
    :meth:`document`, ``to_dict`` and ``from_json``.
    """

    WHAT: ClassVar[str]
    ERROR: ClassVar[type[Exception]]

    @classmethod
    def document(cls) -> type[BaseModel]:
        """The strict document its JSON object is checked against."""
        raise NotImplementedError

    def to_dict(self) -> JsonObject:
        """Its JSON object."""
        raise NotImplementedError

    @classmethod
    def from_json(cls, text: str) -> Any:
        """Parse its JSON text strictly (raises :attr:`ERROR`)."""
        raise NotImplementedError

    def to_json(self, path: str | Path | None = None) -> str:
        """Serialize; write to ``path`` when given. Returns the JSON text.

        The text is checked against :meth:`document` first: a file this planner could not read back is never
        written.

        Raises:
            ERROR: it does not fit its schema (the field named: e.g. a field of the wrong type).
            PlannerError: ``path`` cannot be written.
        """
        text = dump_checked(self.document(), self.to_dict(), self.ERROR, self.WHAT)
        if path is not None:
            try:
                Path(path).write_text(text)
            except OSError as e:
                raise PlannerError(f"cannot write {str(path)!r}: {e.strerror}") from None
        return text

    @classmethod
    def from_dict(cls, d: Any) -> Any:
        """Build from a parsed JSON object, validated as its JSON text is (:meth:`from_json`)."""
        return cls.from_json(json.dumps(d))

    @classmethod
    def load(cls, path: str | Path) -> Any:
        """Read its JSON file (:meth:`from_json`).

        Raises:
            ERROR: the file cannot be read (named), or as :meth:`from_json`.
        """
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise cls.ERROR(f"cannot read {cls.WHAT} {str(path)!r}: {e.strerror}") from None
        return cls.from_json(text)
