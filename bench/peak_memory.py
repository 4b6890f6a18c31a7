"""Benchmark: the simulator's total peak memory against the measured peak, per plan.

    python -m bench.peak_memory [studies/llama-cpu.toml studies/gpt2-cpu.toml] [--json out.json]
    python -m bench.peak_memory --refit run.json ...   # saved runs, today's simulator, no ranks

For each study, on its ranks: record a profile (which measures FSDP2's
default's peak and the optimizer step's temporaries); build the fidelity
bench's plans (``bench.fidelity``) and, from uniform depth 1 with async
unshard, the plans that keep the last 1, 3 and all blocks unsharded after
forward; run each plan for one warm-up step and
:data:`runtime.recording.peak_memory.PEAK_STEPS` measured steps
(the step runner's peak steps, ``runtime.recording.steps``): the median over steps of the
max across ranks (:func:`runtime.recording.peak_memory.peak_of_steps`).
Prints, per plan, the measured and the predicted peak and the error, and
the median |error|; the same against each plan's lowest rank-step (a
diagnostic, not the target: on CPU the steps with none of gloo's copies of the
reduce-scatter input alive, which the simulator does not model); then the
predicted and measured extra memory of keeping blocks unsharded. Target:
median |error| <= 3%.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

import click

from bench.fidelity import fidelity_plans
from bench.ranks import json_flag, report_saved, run_studies, saved_run_options, studies_argument
from planner.units import mib

if TYPE_CHECKING:
    from planner.artifacts.plan import Plan
    from planner.artifacts.profile import Profile

MODULE = "bench.peak_memory"


def plans_for(profile: Profile) -> dict[str, Plan]:
    """The fidelity bench's plans, plus uniform depth 1 async keeping the last 1, 3 and all blocks unsharded."""
    from search_spaces import uniform
    from search_spaces.assign import keep_unsharded

    plans = fidelity_plans(profile)
    base = uniform.build(profile, 1, 1).with_knobs(unshard_async_op=True)
    blocks = len(profile.modules) - 1
    for k in sorted({1, min(3, blocks), blocks}):
        plans[f"prefetch 1 async, last {k} kept unsharded"] = keep_unsharded(base, profile, k)
    return plans


def rank_main(study: str, out: str | None) -> None:
    """Every rank: record, then each plan's peak over measured steps; rank 0 reports (and writes ``out``)."""
    import torch.distributed as dist

    from planner.artifacts.config import load_study_config
    from runtime.ranks.collectives import gather_objects
    from runtime.ranks.rank import job_rank
    from runtime.recording.peak_memory import PEAK_STEPS, peak_of_steps
    from runtime.recording.recorder import record_profile
    from runtime.recording.steps import WorkloadSteps
    from runtime.timing import PEAK, WARMUP, RoundStep
    from runtime.workload import build_study_workload

    config = load_study_config(study)
    with job_rank(config.launch) as rank:
        mesh = rank.mesh
        workload = build_study_workload(config.workload, mesh)
        profile = record_profile(workload, warmup_steps=1, steps=2, repeats=config.measure.profile_repeats)
        plans = plans_for(profile)
        runner = WorkloadSteps(workload, list(plans.values()))
        local: list[list[int]] = [[] for _ in plans]  # per plan, this rank's peak in each of its peak steps
        for i in range(len(plans)):
            for order in [RoundStep(WARMUP, i)] + [RoundStep(PEAK, i)] * PEAK_STEPS:
                runner.step(order, local)
        gathered = gather_objects(local)
        if dist.get_rank() == 0:
            run = {"study": config.name, "profile": profile.to_dict(),
                   "rows": [{"plan": n, "plan_json": plans[n].to_dict(),
                             "measured_peak_bytes": peak_of_steps([g[i] for g in gathered]),
                             "per_rank_peak_bytes": [g[i] for g in gathered]} for i, n in enumerate(plans)]}
            report(run)
            if out:
                Path(out).write_text(json.dumps(run, indent=1))
        del workload
        rank.ended = True


def lowest_step_errors(rows: list[tuple[int, list[list[int]]]]) -> list[float]:
    """Per plan, its predicted peak (bytes) against the lowest of its measured rank-steps (bytes, per rank per step),
    signed %. On CPU a step's peak moves by whole blocks with the copies of the reduce-scatter input that gloo keeps
    alive ([Note] at ``PEAK_STEPS`` in ``runtime/recording/peak_memory.py``); the lowest step is the one with none."""
    errors = []
    for predicted, per_rank in rows:
        lowest = min(min(steps) for steps in per_rank)
        errors.append(100 * (predicted - lowest) / lowest)
    return errors


def report(run: dict) -> dict:
    """Print the per-plan table and the summary of one run; returns the summary."""
    from planner.artifacts.plan import Plan
    from planner.artifacts.profile import Profile
    from planner.simulation.parameters import simulate

    profile = Profile.from_dict(run["profile"])
    print(f"\n== {run['study']}: total peak memory per rank, measured vs predicted (MiB)")
    print(f"{'plan':<52} {'measured':>9} {'predicted':>9} {'error':>7}")
    errors, rows, per_step = [], {}, []
    for row in run["rows"]:
        plan = Plan.from_dict(row["plan_json"])
        predicted = simulate(profile, plan).peak_bytes
        measured = row["measured_peak_bytes"]
        err = 100 * (predicted - measured) / measured
        errors.append(abs(err))
        rows[row["plan"]] = (measured, predicted)
        if row.get("per_rank_peak_bytes"):
            per_step.append((predicted, row["per_rank_peak_bytes"]))
        print(f"{row['plan']:<52} {mib(measured, unit=False):>9} {mib(predicted, unit=False):>9} {err:>+6.1f}%")
    summary = {"median_abs_error_pct": statistics.median(errors), "max_abs_error_pct": max(errors)}
    print(f"median |error| {summary['median_abs_error_pct']:.1f}%, max {summary['max_abs_error_pct']:.1f}% "
          f"over {len(errors)} plans (target: median <= 3%)")
    if per_step:
        lowest = [abs(e) for e in lowest_step_errors(per_step)]
        median = summary["lowest_step_median_abs_error_pct"] = statistics.median(lowest)
        print(f"against each plan's lowest rank-step (not the target's figure; on CPU the steps with no gloo copy of "
              f"a reduce-scatter input alive): median |error| {median:.1f}%, max {max(lowest):.1f}%")
    temps = [m.backward_temp_bytes for f, m in profile.modules.items() if f != profile.root_fqn]
    if temps:
        root = profile.modules[profile.root_fqn].backward_temp_bytes
        print(f"backward temporaries in the profile: the root {mib(root)}, a module's median "
              f"{mib(int(statistics.median(temps)))} (0: not measured, or a profile before them)")
    base = rows.get("uniform depth 1 async")
    if base:
        print("extra memory of keeping blocks unsharded, against uniform depth 1 async (MiB): measured / predicted")
        for name, (m, p) in rows.items():
            if "kept unsharded" in name:
                print(f"  {name:<50} {mib(m - base[0], unit=False):>8} / {mib(p - base[1], unit=False):<8}")
    return summary


@click.command(help=__doc__)
@studies_argument
@saved_run_options
def main(studies: tuple[str, ...], json_out: str | None, refit: tuple[str, ...]) -> None:
    if report_saved(refit, report):
        return
    run_studies(MODULE, studies, lambda study: [study, *json_flag(json_out)], lambda study: rank_main(study, json_out))


if __name__ == "__main__":
    main()
