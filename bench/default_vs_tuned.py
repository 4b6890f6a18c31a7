"""Benchmark: FSDP2's default vs tuned plans, measured side by side, and the
simulator's prediction error for each measured plan.

    python -m bench.default_vs_tuned studies/llama-cpu.toml [--plan studies/llama-cpu.plan.json] [--rounds 7]

Starts the study's ranks itself (or runs under torchrun). In one run it
records a profile, then measures, interleaved A B C ..., FSDP2's default, the
tuned plan (from --plan; the study's plan JSON by default) and a few uniform
plans, and prints per plan: measured median ms (max across ranks), ratio to
the default, predicted ms and the prediction error; then the median and max
absolute error and the Spearman rank correlation of predicted vs measured.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from bench.ranks import json_flag, run_studies

MODULE = "bench.default_vs_tuned"
UNIFORM = [(1, 1, True), (2, 2, True), (3, 3, True), (1, 1, False), (0, 1, True)]


def rank_main(study: str, plan_path: str | None, rounds: int, json_out: str | None) -> None:
    """Every rank: record, measure the plans interleaved; rank 0 prints (and writes ``json_out``)."""
    import statistics

    import torch.distributed as dist

    from planner.artifacts.config import load_study_config
    from planner.artifacts.plan import Plan
    from planner.simulation.calibrate import spearman
    from planner.simulation.parameters import simulate
    from runtime.apply import load_plan
    from runtime.measuring.measure import measure_plans
    from runtime.ranks.rank import init_rank, shutdown_rank
    from runtime.recording.recorder import record_profile
    from runtime.workload import build_study_workload
    from search_spaces import uniform

    config = load_study_config(study)
    mesh = init_rank(config.launch.backend)
    workload = build_study_workload(config.workload, mesh)
    profile = record_profile(workload, warmup_steps=1, steps=config.measure.steps,
                             repeats=config.measure.profile_repeats)
    plans = {"FSDP2 default": Plan.default(profile)}
    plan_path = plan_path or config.default_output(".plan.json")
    if os.path.exists(plan_path):
        plans["tuned (" + os.path.basename(plan_path) + ")"] = load_plan(plan_path)
    for f, b, a in UNIFORM:
        plans[f"uniform fwd {f} bwd {b} async {a}"] = uniform.build(profile, f, b).with_knobs(unshard_async_op=a)
    names = list(plans)
    step_ms = measure_plans(workload, [plans[n] for n in names], rounds, warmup_steps=1)
    if dist.get_rank() == 0:
        default_ms = statistics.median(step_ms[0])
        rows = []
        print(f"\n{config.name}: {len(names)} plans x {rounds} rounds, interleaved, "
              f"{dist.get_world_size()} ranks ({config.launch.backend})")
        print(f"{'plan':<44} {'measured ms':>11} {'vs default':>10} {'predicted ms':>12} {'error %':>8}")
        for name, times in zip(names, step_ms, strict=True):
            measured = statistics.median(times)
            predicted = simulate(profile, plans[name]).step_ms
            err = 100 * (predicted - measured) / measured
            rows.append({"plan": name, "measured_ms": measured, "ratio": measured / default_ms,
                         "predicted_ms": predicted, "error_pct": err, "steps_ms": times})
            print(f"{name:<44} {measured:>11.1f} {measured / default_ms:>10.3f} {predicted:>12.1f} {err:>+8.1f}")
        errs = [abs(r["error_pct"]) for r in rows]
        rho = spearman([r["predicted_ms"] for r in rows], [r["measured_ms"] for r in rows])
        print(f"\nprediction error: median |error| {statistics.median(errs):.1f}%, max {max(errs):.1f}%; "
              f"Spearman rank correlation {rho:.2f}")
        if json_out:
            Path(json_out).write_text(json.dumps(rows, indent=1))
    del workload
    shutdown_rank()


@click.command(help=__doc__)
@click.argument("study", type=click.Path(dir_okay=False))
@click.option(
    "--plan", "plan_path", type=click.Path(dir_okay=False), help="tuned plan JSON (default: the study's plan)"
)
@click.option("--rounds", default=7, show_default=True, help="interleaved rounds, one step of every plan each")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="also write the rows as JSON here")
def main(study: str, plan_path: str | None, rounds: int, json_out: str | None) -> None:
    forward = [study, "--rounds", str(rounds)] + (["--plan", plan_path] if plan_path else []) + json_flag(json_out)
    run_studies(MODULE, [study], lambda _: forward,
                lambda s: rank_main(s, plan_path, rounds, json_out))


if __name__ == "__main__":
    main()
