"""The study TOML's reference, generated from its pydantic tables (:mod:`planner.artifacts.tables`).

Each key's type, default and allowed range come from its field; its meaning from the ``Attributes:`` section of its
table's docstring, the one place it is written. The docs site's "Study TOML reference" page is this text
(``docs/hooks.py`` inserts it at build time), so the page cannot drift from what :func:`load_study_config` accepts.
"""

from __future__ import annotations

import enum
import inspect
import re
import types
import typing
from dataclasses import dataclass

from pydantic.fields import FieldInfo

from planner.artifacts.tables import TABLES, Table

_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


@dataclass(frozen=True)
class KeyReference:
    """One key of a study TOML table, as a reader needs it.

    Attributes:
        table: the TOML table, e.g. ``"search"``.
        key: the key, e.g. ``"sim_trials"``.
        type: what to write, e.g. ``"int"``, ``"str"``, ``"one of tpe, nsga2, random"``.
        default: the default as TOML would write it, or ``"required"``.
        bounds: the allowed range, e.g. ``">= 0"``, or ``""``.
        meaning: the key's description from its table's docstring.
    """

    table: str
    key: str
    type: str
    default: str
    bounds: str
    meaning: str


def attribute_docs(docstring: str) -> dict[str, str]:
    """The ``Attributes:`` section of a Google-style docstring: attribute name -> its text, on one line.

    A line naming several attributes (``min_rounds, max_rounds: ...``) gives each the same text. Names missing from
    the section are missing from the result.
    """
    found: dict[str, str] = {}
    lines = inspect.cleandoc(docstring).splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return found
    names: list[str] = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        entry = re.match(r"^\s{4}([a-z_][a-z0-9_, ]*):\s*(.*)$", line)
        if entry and not line.startswith(" " * 8):
            names = [n.strip() for n in entry.group(1).split(",")]
            for name in names:
                found[name] = entry.group(2).strip()
        else:
            for name in names:
                found[name] = f"{found[name]} {line.strip()}"
    return found


def _type_name(annotation: object) -> str:
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "one of " + ", ".join(f"`{member.value}`" for member in annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _type_name(args[0])
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is dict:
        return "table"
    names = {bool: "bool", int: "int", float: "float", str: "str"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))  # type: ignore[arg-type]


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, dict):
        return "{}"
    return str(value)


def _bounds(field: FieldInfo) -> str:
    found = []
    for item in field.metadata:
        for attr, sign in _BOUNDS:
            if getattr(item, attr, None) is not None:
                found.append(f"{sign} {getattr(item, attr)}")
        if getattr(item, "min_length", None):
            found.append("not empty")
    return ", ".join(found)


def table_keys(name: str, model: type[Table]) -> list[KeyReference]:
    """Every key of one table, in the model's field order.

    Raises:
        ValueError: a key has no description in its table's docstring (write one under ``Attributes:``).
    """
    docs = attribute_docs(model.__doc__ or "")
    keys = []
    for key, field in model.model_fields.items():
        meaning = docs.get(key)
        if not meaning:
            raise ValueError(f"[{name}] {key} has no description: add it under Attributes: in {model.__name__}")
        keys.append(KeyReference(name, key, _type_name(field.annotation), _default(field), _bounds(field), meaning))
    return keys


def toml_reference() -> list[KeyReference]:
    """Every key of every study TOML table, in table order (``[study]``, ``[workload]``, ...)."""
    return [key for name, model in TABLES.items() for key in table_keys(name, model)]


def _markdown(text: str) -> str:
    """reStructuredText's inline markup as markdown: ``code`` and :role:`target` become `code`."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`").replace("|", "\\|")


def toml_reference_markdown() -> str:
    """The reference as markdown: per table, its summary line and a table of key, type, default, range, meaning."""
    out = []
    for name, model in TABLES.items():
        first_paragraph = inspect.cleandoc(model.__doc__ or "").split("\n\n")[0]
        summary = _markdown(" ".join(first_paragraph.split()).split(": ", 1)[-1])
        out += [f"## `[{name}]`", "", summary, "", "| key | type | default | range | meaning |"]
        out.append("|---|---|---|---|---|")
        for k in table_keys(name, model):
            out.append(f"| `{k.key}` | {k.type} | `{k.default}` | {k.bounds} | {_markdown(k.meaning)} |")
        out.append("")
    return "\n".join(out)
