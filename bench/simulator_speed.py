"""Benchmark: simulator speed and a large simulated study.

    python -m bench.simulator_speed [--trials 2000] [--modules 1000]

Prints simulated plan evaluations per second (one core) at 8, 32, 128, 512
and 1024 FSDP modules, for plans compiled once (``Simulator.compile``) and
for fresh plan objects (what a study does); then the wall time of a
simulated study (``planner.study.simulated_stage``, SQLite storage) on a
synthetic profile for each space and sampler, each study read back with
``optuna.load_study``. ``assign`` with TPE runs a tenth of the trials: TPE's
cost per trial grows with the trials and the parameters. Targets: >= 20,000
evaluations/s at 32 modules; a 2000-trial study over ``assign`` or
``per_module`` on 1000 modules in <= 60 s.
"""

from __future__ import annotations

import tempfile
import time

import click


def evals_per_second(n_modules: int, fresh: bool, seconds: float = 1.0) -> float:
    """Simulated steps per second of one ``Simulator``: plans compiled once, or compiled on every run (``fresh``)."""
    from planner.simulation.parameters import simulator_for
    from planner.testing import synthetic_profile
    from search_spaces import uniform

    p = synthetic_profile(n_blocks=n_modules - 1, fwd=10.0, bwd=20.0, ag=8.0, rs=4.0)
    simulator = simulator_for(p)
    plans = [uniform.build(p, f, b).with_knobs(unshard_async_op=a)
             for f in range(4) for b in (1, 2, 3) for a in (False, True)]
    compiled = [simulator.compile(plan) for plan in plans]
    simulator.run(compiled[0])  # compile the kernel / load its cache
    k, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        simulator.run(plans[k % len(plans)] if fresh else compiled[k % len(compiled)])
        k += 1
    return k / (time.perf_counter() - t0)


def study_seconds(n_modules: int, trials: int, space: str, sampler: str) -> tuple[float, int]:
    """Wall seconds of the simulated stage, and the trials ``optuna.load_study`` reads back."""
    import optuna

    from planner.artifacts.config import StudyConfig
    from planner.simulation.parameters import simulator_for
    from planner.storages import open_storage
    from planner.study import simulated_stage
    from planner.testing import synthetic_profile
    from search_spaces import get_space

    p = synthetic_profile(n_blocks=n_modules - 1, fwd=10.0, bwd=20.0, ag=8.0, rs=4.0)
    with tempfile.TemporaryDirectory() as d:
        config = StudyConfig.build(name="speed", storage=f"sqlite:///{d}/speed.db", factory="-", space=space,
                                   sampler=sampler, sim_trials=trials, directory=d)
        t0 = time.perf_counter()
        simulated_stage(simulator_for(p), config, open_storage(config.storage_url), get_space(space),
                        show_progress_bar=False)
        seconds = time.perf_counter() - t0
        return seconds, len(optuna.load_study(study_name="speed.sim", storage=config.storage_url).trials)


@click.command(help=__doc__)
@click.option("--trials", default=2000, show_default=True, help="trials of each simulated study")
@click.option("--modules", default=1000, show_default=True, help="FSDP modules of the studies' synthetic profile")
@click.option("--evals-only", is_flag=True, help="the evaluations per second alone, no study")
def main(trials: int, modules: int, evals_only: bool) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    print(f"{'modules':>8} {'evals/s (built plans)':>22} {'evals/s (fresh plans)':>22}")
    for n in (8, 32, 128, 512, 1024):
        print(f"{n:>8} {evals_per_second(n, False):>22,.0f} {evals_per_second(n, True):>22,.0f}")
    if evals_only:
        return
    print()
    for space, sampler in (("uniform", "tpe"), ("per_module", "nsga2"), ("assign", "nsga2"), ("assign", "tpe")):
        n = trials if sampler != "tpe" or space == "uniform" else trials // 10
        secs, stored = study_seconds(modules, n, space, sampler)
        print(f"{n}-trial simulated study, {space} space, {sampler} sampler, {modules} modules, "
              f"SQLite: {secs:.1f} s ({n / secs:.0f} trials/s); optuna.load_study reads {stored} trials")


if __name__ == "__main__":
    main()
