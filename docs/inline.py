"""The pages read whole where they are linked: what the site would pull in at build time is written into the page.

    python docs/inline.py            # write every inlined part of docs/*.md
    python docs/inline.py --check    # the parts that differ from their sources (tests/test_docs_output.py)

The README links the pages on GitHub, which renders no ``--8<--`` include and runs no MkDocs hook. So a page holds
the text itself, between markers this script fills, and ``--check`` fails where a source moved on:

- ``<!-- inline: PATH -->`` on the line before a fenced block: the block's body is the file at ``PATH`` (a
  capture of ``docs/capture.py``); ``PATH:NAME`` takes the lines of a source file between its
  ``# --8<-- [start:NAME]`` and ``# --8<-- [end:NAME]`` comments, dedented;
- ``<!-- toml-reference -->`` ... ``<!-- /toml-reference -->``: every key of a study TOML
  (:func:`planner.presentation.toml_reference.toml_reference_markdown`).
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "docs"
_FENCED = re.compile(r"(<!-- inline: (?P<source>[^ ]+) -->\n```(?P<lang>\w*)\n)(?P<body>.*?)(\n```\n)", re.S)
_TOML = re.compile(r"(<!-- toml-reference -->\n)(?P<body>.*?)(\n<!-- /toml-reference -->)", re.S)


def source_text(source: str) -> str:
    """The text ``source`` (``PATH`` or ``PATH:NAME``) stands for, without its final newline.

    Raises:
        ValueError: no such file, or no such section in it (the message names it).
    """
    path, _, section = source.partition(":")
    file = ROOT / path
    if not file.is_file():
        raise ValueError(f"{source}: no such file")
    text = file.read_text()
    if section:
        m = re.search(rf"^[ \t]*# --8<-- \[start:{section}\]\n(.*?)^[ \t]*# --8<-- \[end:{section}\]", text,
                      re.S | re.M)
        if m is None:
            raise ValueError(f"{source}: no section {section!r} in {path}")
        text = textwrap.dedent(m.group(1))
    if "\n```" in text:
        raise ValueError(f"{source}: holds a fence of its own, which would end the page's block")
    return text.rstrip("\n")


def inlined(page: str) -> str:
    """``page``'s markdown with every marked part written from its source."""
    from planner.presentation.toml_reference import toml_reference_markdown

    page = _FENCED.sub(lambda m: m.group(1) + source_text(m.group("source")) + m.group(5), page)
    return _TOML.sub(lambda m: m.group(1) + "\n" + toml_reference_markdown().strip("\n") + "\n" + m.group(3), page)


def pages() -> list[Path]:
    """The docs site's markdown pages."""
    return sorted(PAGES.glob("*.md"))


def check() -> list[str]:
    """The pages whose inlined parts differ from their sources (one line each)."""
    return [f"{p.relative_to(ROOT)}: an inlined part differs from its source; run python docs/inline.py"
            for p in pages() if inlined(p.read_text()) != p.read_text()]


def write() -> list[Path]:
    """Write every page whose inlined parts moved on; the pages written."""
    written = []
    for p in pages():
        text = p.read_text()
        if inlined(text) != text:
            p.write_text(inlined(text))
            written.append(p)
    return written


def main() -> None:
    """Write the inlined parts, or check them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="Compare the pages with their sources.")
    if parser.parse_args().check:
        problems = check()
        print("\n".join(problems) or "docs: every inlined part is up to date")
        sys.exit(1 if problems else 0)
    for p in write():
        print(f"wrote {p.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
