"""Benchmark: does the tuner leave the process as it found it? FSDP2's default step before and after the recorder's
isolated passes in one process, against the spread between fresh processes.

    python -m bench.process_as_found [studies/llama-cpu.toml] [--pairs 3] [--steps 8] [--arms passes,fresh]
    python -m bench.process_as_found --refit out.json        # a saved run reported again, no ranks

Each launch is a fresh ``torchrun`` process of the study's ranks on its workload under FSDP2's default, and times
``--steps`` default steps (max across ranks; warm-up steps untimed first), then does its arm's work, then times
``--steps`` more:

- ``passes``: ``record_profile`` in between, as ``tune`` records (warm-up, the default's peak steps, the isolated
  passes that hold every module unsharded at once where the device allows, the timed steps), with what the tuner
  gives back after its passes (``Device.release_cache``);
- ``trim``: the same, then glibc's ``malloc_trim(0)`` (the free heap given back to the kernel), a candidate for what
  a CPU tuner should give back;
- ``fresh``: nothing in between but an idle wait as long as the last ``passes`` launch's (the control: the same
  process's own drift over the same time, no passes).

The arms alternate, the order rotated each round (``--pairs`` rounds). The report: per launch, the median step
before and after and their ratio; the spread between fresh processes (each launch's first median against the
previous launch's, every pair of adjacent launches: the arms differ only after their first median); and whether
each ``passes`` launch's after/before ratio lies within that spread.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import click

from bench.ranks import as_tune_ranks, report_saved, saved_run_options, studies_argument

MODULE = "bench.process_as_found"
ARMS = ("passes", "trim", "fresh")
WARMUP_STEPS = 2


def _median_default_steps(workload: Any, steps: int, counter: Any) -> list[float]:
    """``steps`` timed steps of FSDP2's default (the plan the model has), each step's max across ranks, ms."""
    from runtime.current import fsdp2_default
    from runtime.measuring.measure import measure_plans
    from runtime.recording.steps import WorkloadSteps

    runner = WorkloadSteps(workload, [fsdp2_default(workload.model)], counter=counter, applied=0)
    [times] = measure_plans(runner, [[0] for _ in range(steps)], warmup_steps=0)
    return times


def _malloc_trim() -> None:
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)


def rank_main(study: str, arm: str, steps: int, idle_s: float, out: str) -> None:
    """Every rank: the launch's default steps, its arm's work between them; rank 0 writes ``{"before", "after":
    [ms per step], "between_s"}`` to ``out``."""
    import torch.distributed as dist

    from planner.artifacts.config import load_study_config
    from runtime.ranks.rank import job_rank
    from runtime.recording.recorder import record_profile
    from runtime.timing import StepCounter
    from runtime.workload import build_study_workload

    as_tune_ranks()
    config = load_study_config(study)
    with job_rank(config.launch) as rank:
        workload = build_study_workload(config.workload, rank.mesh)
        counter = StepCounter()
        _median_default_steps(workload, WARMUP_STEPS, counter)
        before = _median_default_steps(workload, steps, counter)
        t0 = time.monotonic()
        if arm in ("passes", "trim"):
            m = config.measure
            record_profile(workload, warmup_steps=max(1, m.warmup_steps), steps=m.steps, repeats=m.profile_repeats,
                           budget=config.search.budget())
            if arm == "trim":
                _malloc_trim()
        else:
            time.sleep(idle_s)
        counter.index += 1_000  # every arm's later steps draw the same batches (the recorder drew its own)
        dist.barrier()
        between = time.monotonic() - t0
        after = _median_default_steps(workload, steps, counter)
        if dist.get_rank() == 0:
            Path(out).write_text(json.dumps({"before": before, "after": after, "between_s": between}))
        rank.ended = True


def report(run: dict) -> dict:
    """Print the launches and the verdict (``run``: ``{"study", "launches": [{"arm", "before", "after",
    "between_s"}]}``); returns the summary."""
    launches = run["launches"]
    print(f"\n== {run['study']}: FSDP2's default before and after, {len(launches)} launches")
    print(f"{'launch':<8}{'arm':<8}{'before ms':>11}{'after ms':>11}{'after/before':>14}{'between s':>11}")
    firsts = []
    for i, launch in enumerate(launches):
        b, a = statistics.median(launch["before"]), statistics.median(launch["after"])
        launch["ratio"] = a / b
        firsts.append(b)
        print(f"{i:<8}{launch['arm']:<8}{b:>11.1f}{a:>11.1f}{a / b:>14.3f}{launch['between_s']:>11.1f}")
    between = [firsts[i] / firsts[i - 1] for i in range(1, len(firsts))]
    low, high = min(between), max(between)
    print(f"spread between fresh processes (first medians of adjacent launches): {low:.3f} to {high:.3f} "
          f"({len(between)} pairs)")
    summary: dict[str, Any] = {"study": run["study"], "between": [low, high], "arms": {}}
    for arm in ARMS:
        ratios = [x["ratio"] for x in launches if x["arm"] == arm]
        if not ratios:
            continue
        within = [low <= r <= high for r in ratios]
        summary["arms"][arm] = {"ratios": ratios, "within": within}
        print(f"{arm}: after/before {', '.join(f'{r:.3f}' for r in ratios)}; within the spread between fresh "
              f"processes: {sum(within)} of {len(ratios)}")
    return summary


@click.command(help=__doc__)
@studies_argument
@saved_run_options
@click.option("--pairs", default=3, show_default=True, help="rounds of the arms, the order rotated")
@click.option("--steps", default=8, show_default=True, help="timed default steps before and after")
@click.option("--arms", default="passes,fresh", show_default=True, help="comma-separated: passes, trim, fresh")
@click.option("--rank-arm", type=click.Choice(ARMS), hidden=True)
@click.option("--rank-idle", type=float, default=0.0, hidden=True)
@click.option("--rank-out", hidden=True)
def main(studies: tuple[str, ...], json_out: str | None, refit: tuple[str, ...], pairs: int, steps: int, arms: str,
         rank_arm: str | None, rank_idle: float, rank_out: str | None) -> None:
    import sys
    import tempfile

    from planner.artifacts.config import load_study_config
    from planner.errors import PlannerError
    from runtime.ranks.launch import in_torchrun, launch_ranks

    if report_saved(refit, report):
        return
    study = (list(studies) or ["studies/llama-cpu.toml"])[0]
    if in_torchrun():
        rank_main(study, rank_arm, steps, rank_idle, rank_out)
        return
    order = [a.strip() for a in arms.split(",") if a.strip()]
    if not order or any(a not in ARMS for a in order):
        raise click.BadParameter(f"{arms!r}: write arms from {', '.join(ARMS)}, comma-separated", param_hint="--arms")
    try:
        launch = load_study_config(study).launch
    except PlannerError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    folder = Path(tempfile.mkdtemp(prefix="process-as-found-"))
    run: dict[str, Any] = {"study": study, "launches": []}
    idle = 60.0
    for r in range(pairs):
        for arm in order[r % len(order):] + order[:r % len(order)]:
            out = folder / f"{len(run['launches'])}.json"
            code = launch_ranks([study, "--steps", str(steps), "--rank-arm", arm, "--rank-idle", str(idle),
                                 "--rank-out", str(out)], launch, module=MODULE)
            if code:
                sys.exit(code)
            result = json.loads(out.read_text())
            if arm != "fresh":
                idle = result["between_s"]
            run["launches"].append({"arm": arm, **result})
            print(f"launch {len(run['launches'])}: {arm}, between {result['between_s']:.1f} s", file=sys.stderr)
    if json_out:
        Path(json_out).write_text(json.dumps(run, indent=1))
    report(run)


if __name__ == "__main__":
    main()
