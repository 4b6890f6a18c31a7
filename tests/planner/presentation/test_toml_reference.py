"""The study TOML reference is generated from the tables themselves: every key, its default and its meaning."""

from __future__ import annotations

import pytest
from pydantic import Field

from planner.artifacts.tables import TABLES, Table
from planner.presentation.toml_reference import attribute_docs, table_keys, toml_reference, toml_reference_markdown


def test_every_key_of_every_table_is_in_the_reference_with_its_default():
    reference = {(k.table, k.key): k for k in toml_reference()}
    expected = {(table, key) for table, model in TABLES.items() for key in model.model_fields}
    assert set(reference) == expected
    assert reference[("search", "sim_trials")].default == str(TABLES["search"].model_fields["sim_trials"].default)
    assert reference[("study", "name")].default == "required"
    assert reference[("search", "memory_budget")].default == "unset"
    assert reference[("measure", "alpha")].bounds == "> 0.0, <= 0.5"
    assert "tpe" in reference[("search", "sampler")].type and "nsga2" in reference[("search", "sampler")].type


def test_the_markdown_has_one_section_per_table_and_one_row_per_key():
    text = toml_reference_markdown()
    for table, model in TABLES.items():
        assert f"## `[{table}]`" in text
        for key in model.model_fields:
            assert f"| `{key}` |" in text
    assert "``" not in text and ":class:" not in text  # reStructuredText markup turned into markdown


def test_attributes_naming_several_keys_and_continuation_lines():
    docs = attribute_docs("""Summary.

    Attributes:
        low, high: the bounds,
            inclusive.
        step: one step.

    More text.
    """)
    assert docs == {"low": "the bounds, inclusive.", "high": "the bounds, inclusive.", "step": "one step."}


def test_a_key_without_a_description_is_refused_by_name():
    class Undocumented(Table):
        """``[x]``: a table.

        Attributes:
            known: documented.
        """

        known: int = 1
        forgotten: int = Field(2, ge=0)

    with pytest.raises(ValueError, match=r"\[x\] forgotten has no description"):
        table_keys("x", Undocumented)
