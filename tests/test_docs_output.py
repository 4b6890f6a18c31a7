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
        plans = db.execute("SELECT is_default, measured_ms FROM planner_plans").fetchall()
        studies = dict(db.execute("SELECT s.study_name, count(*) FROM trials t JOIN studies s USING (study_id) "
                                  "GROUP BY s.study_name").fetchall())
        verdicts = db.execute("SELECT json_extract(confirmation_json, '$.verdict') FROM planner_confirmations "
                              "WHERE confirmation_json IS NOT NULL").fetchall()
    assert sum(d for d, _ in plans) == 1 and all(ms > 0 for _, ms in plans) and len(plans) >= 2
    assert studies["quickstart"] == len(plans) and studies["quickstart.sim"] > 0
    assert len(verdicts) == 1 and verdicts[0][0] in ("faster", "provisional", "no significant difference", "slower")
