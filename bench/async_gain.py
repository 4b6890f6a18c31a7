"""Benchmark: where an async plan's gain comes from on CPU, read from traces of FSDP2's default and async plans.

    python -m bench.async_gain [studies/llama-cpu.toml] [--rounds 4] [--json out.json]
    python -m bench.async_gain --refit run.json

On the reference Llama the plans with ``unshard_async_op`` ran 0.80-0.90 of FSDP2's default in every CPU fidelity
run, "uniform depth 0 async" (no forward prefetch; FSDP2's default backward prefetch of one module) among them,
where the simulator predicts 0.97-0.98 (bench/results/NOTES.md). Every rank builds one model, applies each plan in
turn and traces one step of it (a profiler cycle of one untraced step, one warm-up and one traced step), ``--rounds``
rounds, the plans' order rotated. Rank 0 splits each traced step of the loop's thread into (:func:`split_step`):

- ``compute``: the stretches between FSDP2's labels (each module's own compute, the loss, the loop), by phase;
- FSDP2's labels by kind (``all_gather``: the copy-in and, in a synchronous all-gather, the wait for gloo;
  ``all_gather_copy_out``: in an async one also the wait; ``post_backward_reduce``: the reduce-scatter; the rest),
  by phase;
- the optimizer step;

and prints each part's median over rounds, per plan, with the paired per-round ratio of the plan's step to the
default's. The part that shrinks is where the gain is.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import click

from bench.ranks import json_flag, report_saved, run_studies, saved_run_options, studies_argument, user_profiler

MODULE = "bench.async_gain"
PLANS = ("FSDP2 default", "uniform depth 0 async", "uniform depth 1 async", "uniform depth 1")


def rank_main(study: str, rounds: int, out: str | None) -> None:
    """Every rank: the plans in turn, one traced step each, ``rounds`` rounds; rank 0 reports."""
    import torch
    import torch.distributed as dist

    from planner.artifacts.config import load_study_config
    from planner.artifacts.plan import Plan
    from runtime.apply import apply_plan
    from runtime.collectives import gather_objects
    from runtime.rank import init_rank, shutdown_rank
    from runtime.recorder import record_profile
    from runtime.workload import build_study_workload, train_step
    from search_spaces import uniform

    config = load_study_config(study)
    mesh = init_rank(config.launch.backend)
    workload = build_study_workload(config.workload, mesh)
    profile = record_profile(workload, warmup_steps=1, steps=2, repeats=1)  # the orders and fingerprint only
    plans = {"FSDP2 default": Plan.default(profile), "uniform depth 0 async": uniform.build(profile, 0, 1, True),
             "uniform depth 1 async": uniform.build(profile, 1, 1, True),
             "uniform depth 1": uniform.build(profile, 1, 1, False)}
    folder = gather_objects(tempfile.mkdtemp(prefix="async-gain-") if dist.get_rank() == 0 else None)[0]
    schedule = torch.profiler.schedule(wait=1, warmup=1, active=1, repeat=1)
    step = 0
    for r in range(rounds):
        for i in range(len(PLANS)):
            name = PLANS[(i + r) % len(PLANS)]
            apply_plan(workload.model, plans[name])
            profiler = user_profiler(mesh.device_type, f"{folder}/{r}-{PLANS.index(name)}",
                                     lambda n, offset=step: schedule(max(0, n - offset)))
            profiler.step_num = step
            with profiler as prof:
                for _ in range(3):
                    train_step(workload, step)
                    step += 1
                    prof.step()
            dist.barrier()
    apply_plan(workload.model, plans["FSDP2 default"])
    if dist.get_rank() == 0:
        run = {"study": config.name, "rounds": rounds, "traces": folder,
               "parts": {name: [split_step([f"{folder}/{r}-{PLANS.index(name)}"]) for r in range(rounds)]
                         for name in PLANS}}
        report(run)
        if out:
            Path(out).write_text(json.dumps(run))
    del workload
    shutdown_rank()


def split_step(folders: list[str]) -> dict[str, float]:
    """One traced step's parts, ms, the most of the ranks per part: ``step``; ``compute fwd``/``compute bwd``
    (:attr:`planner.traces.fsdp_steps.RankStep.fwd_ms` and ``bwd_ms`` summed); ``<label kind> fwd|bwd``, the
    top-level FSDP2 labels' time on the loop's thread by kind and phase (forward until the first ``pre_backward``);
    ``optimizer``."""
    from planner.traces.fsdp_steps import _Label, _top_level, fsdp_label, rank_steps
    from planner.traces.kineto import read_trace, trace_files

    per_rank = []
    for path in trace_files(folders):
        trace = read_trace(path)
        [rs] = rank_steps(trace)
        labels = [_Label(*k, e) for e in trace.cpu if (k := fsdp_label(e)) is not None]
        main = max({lb.event.thread for lb in labels if lb.kind == "pre_forward"},
                   key=lambda t: sum(lb.event.thread == t and lb.kind == "pre_forward" for lb in labels))
        labels = [lb for lb in labels if lb.event.thread == main]
        backward_at = min(lb.event.ts for lb in labels if lb.kind == "pre_backward")
        parts = defaultdict(float, {"step": rs.step_ms, "compute fwd": sum(rs.fwd_ms.values()),
                                    "compute bwd": sum(rs.bwd_ms.values()), "optimizer": rs.optimizer_ms or 0.0})
        for lb in _top_level(labels):
            parts[f"{lb.kind} {'bwd' if lb.event.ts >= backward_at else 'fwd'}"] += lb.event.dur / 1e3
        per_rank.append(parts)
    keys = sorted({k for p in per_rank for k in p})
    return {k: max(p.get(k, 0.0) for p in per_rank) for k in keys}


def report(run: dict) -> dict[str, dict[str, float]]:
    """Print each plan's parts (medians over rounds) and its paired step ratio to the default; returns the
    medians."""
    parts = run["parts"]
    default = parts["FSDP2 default"]
    keys = sorted({k for rounds in parts.values() for p in rounds for k in p}, key=lambda k: (k != "step", k))
    medians = {name: {k: statistics.median(p.get(k, 0.0) for p in rounds) for k in keys}
               for name, rounds in parts.items()}
    print(f"\n== {run['study']}: one traced step a plan and round, {run['rounds']} rounds ({run['traces']}); "
          "medians over rounds, ms, the most of the ranks")
    print(f"{'part':<32}" + "".join(f"{name:>24}" for name in parts))
    for k in keys:
        print(f"{k:<32}" + "".join(f"{medians[name][k]:>24.1f}" for name in parts))
    for name, rounds in parts.items():
        ratios = sorted(p["step"] / d["step"] for p, d in zip(rounds, default, strict=True))
        print(f"{name}: step over the default's, per round {', '.join(f'{x:.3f}' for x in ratios)}")
    return medians


@click.command(help=__doc__)
@studies_argument
@saved_run_options
@click.option("--rounds", default=4, show_default=True, help="rounds of one traced step a plan")
def main(studies: tuple[str, ...], json_out: str | None, refit: tuple[str, ...], rounds: int) -> None:
    if report_saved(refit, report):
        return
    run_studies(MODULE, studies or ("studies/llama-cpu.toml",),
                lambda study: [study, "--rounds", str(rounds), *json_flag(json_out)],
                lambda study: rank_main(study, rounds, json_out))


if __name__ == "__main__":
    main()
