"""Every figure the README and the docs pages quote names its source, and stands in it.

A figure is a decimal (``0.842``, ``991.7``, ``-9.2%``) in prose, tables and lists, outside code (inline code and
fenced blocks) and outside version numbers (``torch 2.14.1``). Its block (a paragraph, a list, or a table with the
paragraph that introduces it and the one under it) must cite at least one file (a Markdown link, resolved from the
page's folder, or a path in backticks: a captured output under ``docs/captured/``, a dated report under
``bench/results/``, a decision record (``docs/decisions/``), the accuracy page, which names each figure's report,
or the test that asserts a computed constant), and the figure must stand in one of them; a directory cites nothing.
On a docs page a block may also rest on what its section cites (the text from its heading to the next); the
README's blocks cite their own.

A figure stands in a file when the file holds it, or a number that rounds to it (``0.0083`` -> ``0.8%`` as a
percentage, ``2.6775`` -> ``2.68``). ``ALLOWED`` lists the figures that need no file, each with why;
``GENERATED`` the pages whose figures are the code's own values, checked against their generator elsewhere. Keep
both short.
"""

from __future__ import annotations

import re
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIGURE = re.compile(r"(?<![\w.\-/])[+-]?(\d+\.\d+)(?![\w.]*\d)")
NUMBER = re.compile(r"(?<![\d.])\d+\.\d+(?!\d)")
VERSION = re.compile(r"(torch|torchtitan|python|nccl|release|transformers|accelerate|datasets|cuda|optuna)"
                     r"(?:[\s=<>~,.\d]|or|to)*$", re.IGNORECASE)
LINK = re.compile(r"\]\(([^)#\s]+)")
PATH = re.compile(r"`([\w./-]+\.(?:md|txt|toml|py))`")
SOURCE_FILES = (".md", ".txt", ".toml", ".py")
# figure -> why it needs no file
ALLOWED: dict[str, str] = {}
# page -> why its figures are the code's own
GENERATED = {
    "toml-reference.md": "the study TOML's defaults and ranges, generated from planner/artifacts/tables.py "
                         "(docs/inline.py; tests/test_docs_output.py checks the page is its generator's output)",
}


def pages() -> list[Path]:
    """The README and every docs page, less the generated pages and the changelog (a history: its figures are the
    releases' own). A decision record (``docs/decisions/``) is a source, not a page that quotes: its figures are
    the evidence it records once, and the pages cite it."""
    docs = sorted((ROOT / "docs").glob("*.md"))
    return [ROOT / "README.md"] + [p for p in docs if p.name not in GENERATED and p.name != "changelog.md"]


def blocks(text: str) -> list[str]:
    """A page's blocks: paragraphs and lists; a table with the paragraph before it (when that ends with ``:``)
    and the one after it; fenced code left out."""
    plain, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
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


def sections(text: str) -> list[str]:
    """A page's sections: each heading with the text up to the next heading (the page's top before the first)."""
    out, current, fenced = [], [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if line.startswith("#") and not fenced:
            out.append("\n".join(current))
            current = []
        current.append(line)
    out.append("\n".join(current))
    return out


def sources(block: str, folder: Path = ROOT) -> list[Path]:
    """The files a block cites: a link from the page's ``folder``, else from the repository's root; a bare file
    name: the one of that name under ``bench/results`` or ``docs/captured``. A directory is a pointer, not a
    source: a figure must stand in a file."""
    files: list[Path] = []
    for cited in LINK.findall(block) + PATH.findall(block):
        candidates = [folder / cited, ROOT / cited]
        if "/" not in cited:
            candidates += sorted((ROOT / "bench" / "results").glob(cited)) + sorted(
                (ROOT / "docs" / "captured").glob(cited))
        path = next((c for c in candidates if c.is_file() and c.suffix in SOURCE_FILES), None)
        if path is not None:
            files.append(path)
    return files


def figures(block: str) -> list[tuple[str, bool]]:
    """The figures of a block, each with whether a ``%`` follows it: decimals outside inline code and version
    numbers."""
    prose = re.sub(r"`[^`]*`", "", block)
    return [(m.group(1), prose[m.end():m.end() + 1] == "%") for m in FIGURE.finditer(prose)
            if not VERSION.search(prose[max(0, m.start() - 30):m.start()])]


def stands_in(figure: str, percent: bool, numbers: set[Decimal]) -> bool:
    """Whether ``figure`` is one of ``numbers`` or a rounding of one (as a percentage of a fraction too)."""
    value = Decimal(figure)
    for wanted in [value] + ([value / 100] if percent else []):
        step = Decimal(1).scaleb(value.as_tuple().exponent - (2 if wanted is not value else 0))
        for n in numbers:
            if n == wanted or (n.as_tuple().exponent < step.as_tuple().exponent and wanted in (
                    n.quantize(step, ROUND_HALF_UP), n.quantize(step, ROUND_HALF_EVEN))):
                return True
    return False


def unsourced(text: str, folder: Path = ROOT, by_section: bool = False) -> list[str]:
    """``figure (block's first words)`` for every figure that cites no file it stands in and is not allowed.

    Args:
        folder: the page's folder, links resolve from it.
        by_section: a block may rest on its section's citations (docs pages), not only its own (the README).
    """
    missing = []
    for section in sections(text) if by_section else [text]:
        shared = sources("\n".join(blocks(section)), folder) if by_section else []
        for block in blocks(section):
            found = figures(block)
            if not found:
                continue
            corpus = "\n".join(p.read_text(errors="ignore") for p in sources(block, folder) + shared)
            numbers = {Decimal(n) for n in NUMBER.findall(corpus)}
            for figure, percent in found:
                if figure in ALLOWED or stands_in(figure, percent, numbers):
                    continue
                missing.append(f"{figure} ({block.strip()[:40]!r})")
    return missing


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_figure_a_page_quotes_stands_in_the_file_it_cites(page):
    assert unsourced(page.read_text(), page.parent, by_section=page.name != "README.md") == []


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


def test_a_docs_page_figure_rests_on_its_section_and_on_roundings_of_its_source():
    accuracy = ROOT / "docs" / "accuracy.md"
    section = ("## A result\n\nFrom the report ([decision](decisions/cpu-step-level.md)).\n\n"
               "The level moved by 9.6% and the ratio by 2.1-5.4%.\n")
    assert unsourced(section, accuracy.parent, by_section=True) == []
    assert unsourced(section.replace("9.6%", "9.7%"), accuracy.parent, by_section=True) == [
        "9.7 ('The level moved by 9.7% and the ratio by')"]
    assert unsourced(section, accuracy.parent) != []  # the README's rule: a block cites its own
    assert stands_in("0.8", True, {Decimal("0.0083")}) and stands_in("2.68", False, {Decimal("2.6775")})
    assert not stands_in("0.9", True, {Decimal("0.0083")}) and not stands_in("2.68", False, {Decimal("2.6")})
