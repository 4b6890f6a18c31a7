"""What importing the packages costs: nothing until a name is used, and a training script loads no planner machinery.

Each case runs in a fresh interpreter and lists the heavy libraries it loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "numba", "optuna", "scipy", "sqlalchemy", "pydantic", "numpy")

LOADED = """
import json, sys
{statement}
print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r}))))
"""


def _loaded(statement: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", LOADED.format(statement=statement, heavy=HEAVY)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("statement", ["import planner", "import runtime", "import planner, runtime, planner.study"])
def test_importing_a_package_loads_no_library(statement):
    assert _loaded(statement) == []


def test_the_search_spaces_need_no_simulator_and_no_study():
    """``search_spaces`` builds plans from the artifacts and the space names: nothing of the planner's
    machinery. The plans it builds carry their JSON schema, so pydantic is the one library it loads."""
    assert set(_loaded("import search_spaces")) <= {"pydantic"}


def test_a_training_script_applying_a_plan_loads_no_simulator_and_no_study():
    """``apply_plan(model, load_plan(path))`` needs torch and the plan artifact, not numba, Optuna or SciPy."""
    loaded = set(_loaded("from runtime import apply_plan, load_plan"))
    assert "torch" in loaded
    assert loaded <= {"torch", "numpy", "pydantic"}  # torch's numpy; the plan's JSON schema


def test_lazy_names_resolve_and_unknown_names_say_so():
    import planner
    import runtime

    assert planner.Plan.__module__ == "planner.artifacts.plan"
    assert runtime.apply_plan.__module__ == "runtime.apply"
    assert "apply_plan" in dir(runtime)
    with pytest.raises(AttributeError, match="module 'runtime' has no attribute 'aply_plan'"):
        runtime.aply_plan  # noqa: B018


def test_the_command_line_loads_none_of_the_tuner_until_a_command_runs():
    """Every rank starts as ``python -m jobs.cli``, a verify rank too, which must load nothing of the tuner
    (``jobs.verify.TUNER_MODULES``): the command line's module imports its commands' machinery inside them."""
    from jobs.verify import TUNER_MODULES

    proc = subprocess.run([sys.executable, "-c", "import json, sys, jobs.cli; print(json.dumps(sorted(sys.modules)))"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [m for m in json.loads(proc.stdout) if any(m == t or m.startswith(t + ".") for t in TUNER_MODULES)] == []
    assert set(_loaded("import jobs.cli")) & {"torch", "numba", "optuna", "scipy", "sqlalchemy"} == set()


def test_a_verify_rank_loads_none_of_the_tuner():
    """A verify rank runs a plan as a user's job does (``jobs.verify``): the modules it imports to build, apply,
    time and gather (the device module among them, which reads the device-memory setting) load nothing of
    ``jobs.verify.TUNER_MODULES``."""
    from jobs.verify import TUNER_MODULES

    imports = ("import json, sys; import jobs.verify, planner.statistics.schedule, runtime.apply, "
               "runtime.ranks.collectives, runtime.ranks.device, runtime.ranks.rank, runtime.timing, "
               "runtime.workload; print(json.dumps(sorted(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", imports], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [m for m in json.loads(proc.stdout) if any(m == t or m.startswith(t + ".") for t in TUNER_MODULES)] == []
