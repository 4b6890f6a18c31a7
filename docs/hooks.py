"""MkDocs hook: the study TOML reference, generated from the pydantic tables when the site is built.

``docs/toml-reference.md`` holds the marker ``<!-- toml-reference -->``; this hook replaces it with
:func:`planner.presentation.toml_reference.toml_reference_markdown`, so the page is what ``load_study_config``
accepts.
"""

from __future__ import annotations

MARKER = "<!-- toml-reference -->"


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Replace the marker in the TOML reference page with the generated tables."""
    if MARKER not in markdown:
        return markdown
    from planner.presentation.toml_reference import toml_reference_markdown

    return markdown.replace(MARKER, toml_reference_markdown())
