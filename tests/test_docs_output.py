"""The docs' captured output cannot drift from the code: ``docs/capture.py --check`` regenerates the what-if outputs,
``studies show``, ``studies best`` and the ``sqlite3`` queries from the committed inputs and study database, and
compares them with ``docs/captured/`` byte for byte; the pages include those files."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
CAPTURED = ROOT / "docs" / "captured"


def test_the_captured_output_is_what_the_code_prints_now():
    proc = subprocess.run([sys.executable, "docs/capture.py", "--check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]


def test_the_pages_include_the_captures_they_describe():
    pages = "\n".join(p.read_text() for p in (ROOT / "docs").glob("*.md")) + (ROOT / "README.md").read_text()
    for path in CAPTURED.glob("*.txt"):
        assert f"docs/captured/{path.name}" in pages, f"no page includes docs/captured/{path.name}"
    assert "captured/timeline.png" in pages


def test_the_documented_queries_answer_from_a_real_study_database():
    """The study database the docs query is a real tune's: FSDP2's default and its candidates measured, the
    simulated study beside them, one survivor's confirmation."""
    with sqlite3.connect(CAPTURED / "quickstart.db") as db:
        plans = db.execute("SELECT is_default, race_median_ms FROM planner_trials "
                           "WHERE study_name = 'quickstart'").fetchall()
        studies = dict(db.execute("SELECT s.study_name, count(*) FROM trials t JOIN studies s USING (study_id) "
                                  "GROUP BY s.study_name").fetchall())
        verdicts = db.execute("SELECT json_extract(confirmation_json, '$.verdict') FROM planner_confirmations "
                              "WHERE confirmation_json IS NOT NULL").fetchall()
    assert sum(d for d, _ in plans) == 1 and all(ms > 0 for _, ms in plans) and len(plans) >= 2
    assert studies["quickstart"] == len(plans) and studies["quickstart.sim"] > 0
    assert len(verdicts) == 1 and verdicts[0][0] in ("faster", "provisional", "no significant difference", "slower")


def _inline():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_inline", ROOT / "docs" / "inline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_pages_read_whole_where_they_are_linked():
    """GitHub renders no ``--8<--`` include and runs no MkDocs hook: every page but the changelog (which the README
    does not link: it links CHANGELOG.md) holds its captures and the TOML reference itself, and they are their
    sources' text; an inlined part edited by hand is caught."""
    inline = _inline()
    assert inline.check() == []
    for page in inline.pages():
        if page.name != "changelog.md":
            assert "--8<--" not in page.read_text(), page
    assert "| `sim_trials` |" in (ROOT / "docs" / "toml-reference.md").read_text()
    page = (ROOT / "docs" / "getting-started.md").read_text()
    edited = page.replace("exposed comm ", "exposed comms", 1)
    assert edited != page and inline.inlined(edited) == page  # the edit is undone by the source's text
