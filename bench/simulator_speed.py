"""Benchmark: simulator speed and a large simulated study.

    python bench/simulator_speed.py [--trials 2000] [--modules 1000]

Prints simulated plan evaluations per second (one core) at 8, 32, 128, 512
and 1024 FSDP modules, for plans whose arrays are already built and for fresh
plan objects (what a study does), then the wall time of a simulated study
(``planner.study.simulated_stage``, SQLite storage, its trials written in one
transaction) on a synthetic profile, for ``uniform`` (TPE), ``per_module``
and ``assign`` (NSGA-II; and ``assign`` with TPE on a tenth of the trials:
TPE's cost per trial grows with the trials and the 193 parameters), each
study then read back with ``optuna.load_study``. Targets: >= 20,000
evaluations/s at 32 modules (issue 4); a 2000-trial study over ``assign`` or
``per_module`` on 1000 modules in <= 60 s (the memory-aware plans issue).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optuna  # noqa: E402

from planner.artifacts.config import StudyConfig  # noqa: E402
from planner.simulation.parameters import simulator_for  # noqa: E402
from planner.storages import open_storage  # noqa: E402
from planner.study import simulated_stage  # noqa: E402
from search_spaces import get_space, uniform  # noqa: E402
from planner.testing import synthetic_profile  # noqa: E402


def evals_per_second(n_modules: int, fresh: bool, seconds: float = 1.0) -> float:
    """Simulated steps per second of one ``Simulator``: plans compiled once, or compiled on every run (``fresh``)."""
    p = synthetic_profile(n_blocks=n_modules - 1, fwd=10.0, bwd=20.0, ag=8.0, rs=4.0)
    simulator = simulator_for(p)
    plans = [uniform.build(p, f, b, a) for f in range(4) for b in (1, 2, 3) for a in (False, True)]
    compiled = [simulator.compile(plan) for plan in plans]
    simulator.run(compiled[0])  # compile the kernel / load its cache
    k, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        simulator.run(plans[k % len(plans)] if fresh else compiled[k % len(compiled)])
        k += 1
    return k / (time.perf_counter() - t0)


def study_seconds(n_modules: int, trials: int, space: str, sampler: str) -> tuple[float, int]:
    """Wall seconds of the simulated stage, and the trials ``optuna.load_study`` reads back."""
    p = synthetic_profile(n_blocks=n_modules - 1, fwd=10.0, bwd=20.0, ag=8.0, rs=4.0)
    with tempfile.TemporaryDirectory() as d:
        config = StudyConfig.build(name="speed", storage=f"sqlite:///{d}/speed.db", factory="-", space=space,
                                   sampler=sampler, sim_trials=trials, directory=d)
        t0 = time.perf_counter()
        simulated_stage(p, config, open_storage(config.storage_url), get_space(space), show_progress_bar=False)
        seconds = time.perf_counter() - t0
        return seconds, len(optuna.load_study(study_name="speed.sim", storage=config.storage_url).trials)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--modules", type=int, default=1000)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    print(f"{'modules':>8} {'evals/s (built plans)':>22} {'evals/s (fresh plans)':>22}")
    for n in (8, 32, 128, 512, 1024):
        print(f"{n:>8} {evals_per_second(n, False):>22,.0f} {evals_per_second(n, True):>22,.0f}")
    print()
    for space, sampler in (("uniform", "tpe"), ("per_module", "nsga2"), ("assign", "nsga2"), ("assign", "tpe")):
        trials = args.trials if sampler != "tpe" or space == "uniform" else args.trials // 10
        secs, stored = study_seconds(args.modules, trials, space, sampler)
        print(f"{trials}-trial simulated study, {space} space, {sampler} sampler, {args.modules} modules, "
              f"SQLite: {secs:.1f} s ({trials / secs:.0f} trials/s); optuna.load_study reads {stored} trials")


if __name__ == "__main__":
    main()
