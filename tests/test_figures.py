"""Every figure the README quotes names its source, and stands in it.

A figure is a decimal (``0.842``, ``991.7``, ``-9.2%``) in the README's prose, tables and lists, outside code (inline
code and fenced blocks) and outside version numbers (``torch 2.14.1``). Its block (a paragraph, a list, or a table
with the paragraph that introduces it and the one under it) must cite at least one text file (a Markdown link or a
path in backticks: a captured output under ``docs/captured/``, a dated report under ``bench/results/``, the
accuracy page, which names each figure's report), and the figure must stand in one of them; a directory cites
nothing. ``ALLOWED`` lists the figures that need no file, each with why; keep it short.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURE = re.compile(r"(?<![\w.\-/])[+-]?(\d+\.\d+)(?![\w.]*\d)")
VERSION = re.compile(r"(torch|torchtitan|python|nccl|release|transformers|accelerate|datasets|cuda|optuna)"
                     r"(?:[\s=<>~,.\d]|or)*$", re.IGNORECASE)
LINK = re.compile(r"\]\(([^)#\s]+)")
PATH = re.compile(r"`([\w./-]+\.(?:md|txt|toml))`")
TEXT_FILES = (".md", ".txt", ".toml")
# figure -> why it needs no file
ALLOWED: dict[str, str] = {}


def blocks(text: str) -> list[str]:
    """The README's blocks: paragraphs and lists; a table with the paragraph before it (when that ends with ``:``)
    and the one after it; fenced code left out."""
    plain, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            plain.append("")
            continue
        plain.append("" if fenced else line)
    paragraphs = [p for p in re.split(r"\n\s*\n", "\n".join(plain)) if p.strip()]
    out: list[str] = []
    table_open = False
    for p in paragraphs:
        is_table = p.lstrip().startswith("|")
        if is_table and out and out[-1].rstrip().endswith(":"):
            out[-1] += "\n" + p
        elif table_open and not is_table:
            out[-1] += "\n" + p
        else:
            out.append(p)
        table_open = is_table
    return out


def sources(block: str) -> list[Path]:
    """The text files a block cites (a bare file name: the one of that name under ``bench/results`` or
    ``docs/captured``). A directory is a pointer, not a source: a figure must stand in a file."""
    files: list[Path] = []
    for cited in LINK.findall(block) + PATH.findall(block):
        path = ROOT / cited
        if not path.exists() and "/" not in cited:
            path = next(iter(sorted((ROOT / "bench" / "results").glob(cited)) + sorted(
                (ROOT / "docs" / "captured").glob(cited))), path)
        if path.is_file() and path.suffix in TEXT_FILES:
            files.append(path)
    return files


def figures(block: str) -> list[str]:
    """The figures of a block: decimals outside inline code and version numbers."""
    prose = re.sub(r"`[^`]*`", "", block)
    return [m.group(1) for m in FIGURE.finditer(prose) if not VERSION.search(prose[max(0, m.start() - 30):m.start()])]


def unsourced(text: str) -> list[str]:
    """``figure (block's first words)`` for every figure that cites no file it stands in and is not allowed."""
    missing = []
    for block in blocks(text):
        found = figures(block)
        if not found:
            continue
        corpus = "\n".join(p.read_text(errors="ignore") for p in sources(block))
        for figure in found:
            if figure in ALLOWED or re.search(rf"(?<![\d.]){re.escape(figure)}(?!\d)", corpus):
                continue
            missing.append(f"{figure} ({block.strip()[:40]!r})")
    return missing


def test_every_figure_in_the_readme_stands_in_the_file_it_cites():
    assert unsourced((ROOT / "README.md").read_text()) == []


def test_a_figure_changed_by_hand_or_left_without_a_source_is_caught():
    readme = (ROOT / "README.md").read_text()
    assert "0.842 [0.791, 0.897]" in readme
    cited = (ROOT / "docs" / "accuracy.md").read_text()
    edited = next(f"0.84{d}" for d in range(10) if f"0.84{d}" not in cited)  # a hand edit its source lacks
    caught = unsourced(readme.replace("0.842 [0.791, 0.897]", f"{edited} [0.791, 0.897]"))
    assert [c.split()[0] for c in caught] == [edited] and "| workload |" in caught[0]
    uncited = "The step takes 123.4 ms here.\n\nAt 0.842 [0.791, 0.897] ([accuracy](docs/accuracy.md)).\n"
    assert unsourced(uncited) == ["123.4 ('The step takes 123.4 ms here.')"]
    assert unsourced("torch 2.14.1 and `torch==2.13.0`;\n```\n1.5\n```\n") == []
