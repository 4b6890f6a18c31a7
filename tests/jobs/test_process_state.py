"""jobs.process_state: ``profile``'s ranks load every library ``tune``'s ranks have loaded before they record."""

from __future__ import annotations

import json
import subprocess
import sys


def _modules(code: str) -> set[str]:
    """The modules loaded after ``code`` runs in a fresh interpreter, the jobs' own left out."""
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True).stdout
    return {name for name in json.loads(out.splitlines()[-1]) if not name.startswith("jobs")}


def test_profile_ranks_load_what_tune_ranks_load():
    """Every module ``import jobs.tune`` adds to a process that has ``jobs.profile``, ``load_tune_modules`` adds too
    (Optuna, SQLAlchemy, tqdm, the study, the search spaces, the measured rounds)."""
    base = "import jobs.profile"
    by_tune = _modules(f"{base}\nimport jobs.tune")
    by_list = _modules(f"{base}\nfrom jobs.process_state import load_tune_modules\nload_tune_modules()")
    assert by_tune - by_list == set()
    assert {"optuna", "sqlalchemy", "tqdm", "search_spaces.session"} <= by_list
