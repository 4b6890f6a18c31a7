"""The shape of JSON data: what an artifact, a study attribute or a factory's keyword arguments hold once parsed."""

from __future__ import annotations

from typing import TypeAlias

from pydantic import JsonValue

__all__ = ["JsonObject", "JsonValue"]

JsonObject: TypeAlias = dict[str, JsonValue]
"""A JSON object: a Plan or Profile document, a trial's user attributes, a factory's keyword arguments
(``JsonValue``: pydantic's recursive JSON type, which also validates them)."""
