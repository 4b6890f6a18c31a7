"""The kernel's numba cache ([Note: The kernel's numba cache]): checked at first compile, safe for ranks
started together.

Each test runs on a fresh copy of the ``planner`` package, so its cache starts
empty and the project's own is left alone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

# Simulate one plan; print whether numba compiled `step` or loaded it from the cache.
FIRST_SIMULATION = """
import json
from planner.artifacts.plan import Plan
from planner.simulation.parameters import simulate
from planner.simulation._kernel.hooks import step
from planner.testing import synthetic_profile
p = synthetic_profile(n_blocks=3)
result = simulate(p, Plan.default(p))
print(json.dumps({"step_ms": result.step_ms, "hits": sum(step.stats.cache_hits.values()),
                  "misses": sum(step.stats.cache_misses.values())}))
"""


@pytest.fixture
def fresh_planner(tmp_path):
    """A copy of the planner package without any cache; returns (its parent folder, its kernel folder)."""
    shutil.copytree(ROOT / "planner", tmp_path / "planner", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path, tmp_path / "planner" / "simulation" / "_kernel"


def _python(code: str, path: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(path), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.Popen([sys.executable, "-c", code], cwd=path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_importing_the_simulator_writes_nothing_and_the_first_compile_checks_the_cache(fresh_planner):
    path, kernel = fresh_planner
    proc = _python("import planner, runtime, planner.simulation.simulator, planner.simulation.parameters", path)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    cache = kernel / "__pycache__"  # numba's cache=True makes the folder when it decorates; it stays empty
    assert not cache.exists() or list(cache.iterdir()) == []  # no stamp, no lock, no machine code: no work
    assert _result(_python(FIRST_SIMULATION, path))["misses"] == 1
    assert (kernel / "__pycache__" / "kernel-sources.sha1").exists()
    assert list((kernel / "__pycache__").glob("hooks.step*.nbi"))


def test_ranks_compiling_at_once_both_succeed_and_the_cache_serves_the_next(fresh_planner):
    path, kernel = fresh_planner
    together = [_python(FIRST_SIMULATION, path) for _ in range(2)]
    first, second = (_result(p) for p in together)
    assert first["step_ms"] == second["step_ms"] > 0
    later = _result(_python(FIRST_SIMULATION, path))
    assert (later["hits"], later["misses"]) == (1, 0)
    assert later["step_ms"] == first["step_ms"]


def test_an_edited_kernel_source_drops_the_cache(fresh_planner):
    """numba checks only the loaded function's own file; the digest covers every kernel file."""
    path, kernel = fresh_planner
    _result(_python(FIRST_SIMULATION, path))
    timeline = kernel / "timeline.py"
    timeline.write_text(timeline.read_text() + "\n# an edit to a callee in another file\n")
    after_edit = _result(_python(FIRST_SIMULATION, path))
    assert (after_edit["hits"], after_edit["misses"]) == (0, 1)
