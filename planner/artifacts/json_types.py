"""The shape of JSON data: what an artifact, a study attribute or a factory's keyword arguments hold once parsed."""

from __future__ import annotations

from typing import TypeAlias

JsonValue: TypeAlias = "None | bool | int | float | str | list[JsonValue] | dict[str, JsonValue]"
"""Any JSON value, as ``json.loads`` returns it."""

JsonObject: TypeAlias = "dict[str, JsonValue]"
"""A JSON object: a Plan or Profile document, a trial's user attributes, a factory's keyword arguments."""
