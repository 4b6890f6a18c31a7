"""The docs' captured output: the commands the docs show, run, and their output written under ``docs/captured/``.

    python docs/capture.py            # the what-if outputs, the timeline picture, studies show and the sqlite3
                                      # queries from the committed study database (seconds to a minute)
    python docs/capture.py --tune     # first a real tune of the quickstart study on 2 CPU ranks (minutes): its
                                      # output and its database become the committed ones
    python docs/capture.py --check    # regenerate into a temporary folder and compare (tests/test_docs_output.py)

The pages hold the captures themselves (``docs/inline.py``: GitHub renders no include), so writing the captures
writes the pages' copies too, and ``--check`` checks both.

Every output is the command's stdout, run from a scratch folder holding the files under the names the docs use,
so nothing of this machine's paths gets in. The what-if outputs are deterministic (seeded search, committed
profiles): ``--check`` compares them byte for byte. A real tune is not (its race is timed): ``--check`` regenerates
``studies show`` and the queries from the committed database byte for byte, and checks the captured tune output
ends with the plan ``studies best`` names from that database.
"""

from __future__ import annotations

import argparse
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import inline  # docs/inline.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
CAPTURED = ROOT / "docs" / "captured"
H100_PROFILE = ROOT / "tests" / "data" / "traces" / "fsdp2-llama-h100-ws1.recorder.json"
QUICKSTART = """# The docs' quickstart study: a 4-block MLP on 2 CPU ranks with gloo, tuned in a few minutes.
[study]
name = "quickstart"

[workload]
factory = "runtime.reference_workloads:mlp"
kwargs = { dim = 512, layers = 4 }

[search]
space = "per_module"
sim_trials = 60
measured_trials = 2
seed = 0

[measure]
warmup_steps = 1
steps = 3
max_rounds = 8
confirm_max_rounds = 12
profile_repeats = 2
"""
# (output file, command line after `prefetch-planner`): the what-if, from a one-GPU profile and from the
# emulated cluster's 4-rank profile; `check` of the hand-set study's plan (`check studies/llama-cpu-hand-set.toml`
# wrote the profile and the plan).
WHAT_IF = [
    ("presets.txt", ["presets"]),
    ("simulate-h100.txt", ["simulate", "h100.profile.json", "--target", "h100-ib400", "--world-size", "64",
                           "--depth", "32"]),
    ("tune-target-h100.txt", ["tune", "llama-gpu.toml", "--from-profile", "h100.profile.json", "--target",
                              "h100-ib400", "--world-size", "64", "--depth", "32", "--sim-trials", "100",
                              "--no-progress"]),
    ("tune-target-emulated.txt", ["tune", "llama-link.toml", "--target", "cpu-emulated-1gbit", "--no-progress"]),
    ("simulate-emulated.txt", ["simulate", "llama-link.profile.json", "llama-link.predicted.plan.json",
                               "--target", "cpu-emulated-1gbit", "--png", "timeline.png"]),
    ("check.txt", ["check", "llama-cpu-hand-set.profile.json", "llama-cpu-hand-set.own.plan.json"]),
]
# The queries docs/studies.md shows, run against the quickstart study's database.
QUERIES = [
    ("the plans measured on the ranks: predicted and race-median step, ms (FSDP2's default flagged)",
     "SELECT trial_number, is_default, round(predicted_ms, 1), round(race_median_ms, 1) FROM planner_trials "
     "WHERE study_name = 'quickstart' ORDER BY trial_number;"),
    ("Optuna's tables: each study's trials by state, and the best value (ms)",
     "SELECT s.study_name, t.state, count(*), round(min(v.value), 1) FROM trials t JOIN studies s USING (study_id) "
     "LEFT JOIN trial_values v ON v.trial_id = t.trial_id AND v.objective = 0 "
     "GROUP BY s.study_name, t.state ORDER BY s.study_name, t.state;"),
    ("the survivor's confirmation, reached in fresh launches after its job: verdict and ratio to the default",
     "SELECT trial_number, json_extract(confirmation_json, '$.verdict'), "
     "round(json_extract(confirmation_json, '$.measured_ratio'), 3) FROM planner_confirmations "
     "WHERE confirmation_json IS NOT NULL;"),
]


def run(args: list[str], cwd: Path) -> str:
    """``prefetch-planner ARGS`` in ``cwd``: ``$ prefetch-planner ARGS`` and its stdout.

    Raises:
        SystemExit: the command failed (its stderr shown).
    """
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"prefetch-planner {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return f"$ prefetch-planner {' '.join(args)}\n{proc.stdout}"


def scratch(folder: Path) -> Path:
    """A scratch folder with the inputs under the docs' names."""
    shutil.copy(H100_PROFILE, folder / "h100.profile.json")
    shutil.copy(ROOT / "studies" / "llama-gpu.toml", folder / "llama-gpu.toml")
    shutil.copy(ROOT / "bench" / "llama-link.toml", folder / "llama-link.toml")
    shutil.copy(CAPTURED / "llama-link.profile.json", folder / "llama-link.profile.json")
    for name in ("llama-cpu-hand-set.profile.json", "llama-cpu-hand-set.own.plan.json"):
        shutil.copy(CAPTURED / name, folder / name)
    (folder / "quickstart.toml").write_text(QUICKSTART)
    return folder


def queries(db: Path) -> str:
    """The :data:`QUERIES` as ``sqlite3`` prints them (``-header -column`` aside: one ``|``-separated row a line)."""
    out = []
    with sqlite3.connect(db) as connection:
        for what, sql in QUERIES:
            rows = connection.execute(sql).fetchall()
            out.append(f"-- {what}\n$ sqlite3 studies/quickstart.db \"{sql}\"")
            out += ["|".join("" if v is None else str(v) for v in row) for row in rows]
            out.append("")
    return "\n".join(out)


def capture(out: Path, tune: bool) -> None:
    """Write every capture into ``out`` (the committed folder, or a temporary one to compare)."""
    with tempfile.TemporaryDirectory(prefix="capture-") as tmp:
        work = scratch(Path(tmp))
        for name, args in WHAT_IF:
            (out / name).write_text(run(args, work))
        shutil.copy(work / "timeline.png", out / "timeline.png")
        db = CAPTURED / "quickstart.db"
        if tune:
            (work / "studies").mkdir()
            shutil.move(str(work / "quickstart.toml"), work / "studies" / "quickstart.toml")
            (out / "tune.txt").write_text(run(["tune", "studies/quickstart.toml", "--no-progress"], work))
            db = work / "studies" / "quickstart.db"
            shutil.copy(db, out / "quickstart.db")
        (work / "studies").mkdir(exist_ok=True)
        if db != work / "studies" / "quickstart.db":
            shutil.copy(db, work / "studies" / "quickstart.db")
        (out / "studies-show.txt").write_text(run(["studies", "show", "quickstart", "--top", "3"], work))
        (out / "studies-best.txt").write_text(run(["studies", "best", "quickstart"], work))
        (out / "sqlite.txt").write_text(queries(work / "studies" / "quickstart.db"))


def check() -> list[str]:
    """Regenerate into a temporary folder; the captures that differ from the committed ones."""
    problems = []
    with tempfile.TemporaryDirectory(prefix="capture-check-") as tmp:
        fresh = Path(tmp)
        capture(fresh, tune=False)
        for path in sorted(fresh.glob("*.txt")):
            committed = CAPTURED / path.name
            if not committed.exists() or committed.read_text() != path.read_text():
                problems.append(f"docs/captured/{path.name} differs from what the code prints now")
        if (fresh / "timeline.png").stat().st_size == 0:
            problems.append("docs/captured/timeline.png: nothing drawn")
    best = (CAPTURED / "studies-best.txt").read_text().splitlines()[1].removeprefix("study quickstart: ")
    tuned = [line for line in (CAPTURED / "tune.txt").read_text().splitlines() if line.startswith("best plan: ")]
    if not tuned or best not in tuned[-1]:
        problems.append("docs/captured/tune.txt does not end with the plan `studies best` names from quickstart.db")
    return problems + inline.check()


def main() -> None:
    """Write the captures, or check them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune", action="store_true", help="Run a real tune first (minutes).")
    parser.add_argument("--check", action="store_true", help="Compare with the committed captures.")
    a = parser.parse_args()
    if a.check:
        problems = check()
        print("\n".join(problems) or "docs/captured: up to date")
        sys.exit(1 if problems else 0)
    capture(CAPTURED, a.tune)
    print(f"wrote {CAPTURED}" + "".join(f", {p.relative_to(ROOT)}" for p in inline.write()))


if __name__ == "__main__":
    main()
