"""Benchmark: do the recorder's isolated collective figures move as the process runs training steps?

    python -m bench.collective_drift [studies/llama-cpu.toml] [--plan steps:2,isolated,measure,...] [--json out.json]
    python -m bench.collective_drift --refit out.json   # a saved run again, no ranks

On the study's ranks, one fresh model, then ``--plan``'s actions in order:

- ``measure``: time, as the recorder does (:func:`runtime.collective_timer.collective_rounds`, ``--repeats``
  rounds after one dropped warm-up round), every module's all-gather and reduce-scatter (counting this rank's
  minor page faults meanwhile), the overlap microbenchmark on CPU (:mod:`runtime.overlap_timer`), then 3 training
  steps between barriers;
- ``by_module``: the same, but every round of a module one after another, module by module (the recorder's
  order before [Note: Collectives timed in rounds]); ``measure:N`` and ``by_module:N`` take N repeats instead;
- ``steps:N``: N untimed training steps (``train_step``);
- ``profile:N``: N ``torch.profiler`` cycles of one untraced, one warm-up and one active step, as
  ``bench.trace_profile`` traces (``profile_memory``, ``record_shapes``);
- ``record``: the whole recorder (``runtime.recorder.record_profile`` with the study's settings); its row holds
  its all-gather and reduce-scatter figures and its default step;
- ``isolated``: the recorder's isolated compute passes (``runtime.recorder.compute_unsharded``: every module
  unsharded at once, then resharded), which ran just before the recorder timed its collectives until 2026-11-26
  ([Note: The collectives are timed before the isolated passes] in ``runtime/recorder.py``);
- ``zero_grad``: ``optimizer.zero_grad(set_to_none=True)``, freeing the sharded gradients;
- ``fwdbwd:N``: N forward-backward passes (``forward_backward``), no optimizer step;
- ``rebuild``: drop the model (``gc.collect()``) and build a fresh one, as ``bench.trace_profile`` does.

Rank 0 prints, per measurement, what ran before it, the sums over modules of the all-gather and reduce-scatter
medians (ms, max across ranks), each over the first measurement's, the median step (ms), the all-gathers' minor
page faults (most of the ranks') and the measured overlap slowdown (mean of the ranks). A recorder that reads
the same at every point shows ratios near 1.
"""

from __future__ import annotations

import gc
import json
import statistics
import tempfile
import time

import click

from bench.ranks import json_flag, report_saved, run_studies, saved_run_options, studies_argument, user_profiler
from runtime.process_usage import process_usage

MODULE = "bench.collective_drift"


ACTIONS = ("measure", "by_module", "record", "isolated", "steps", "fwdbwd", "zero_grad", "profile", "rebuild")


def parse_plan(text: str) -> list[tuple[str, int]]:
    """``"measure,steps:8"`` -> ``[("measure", 0), ("steps", 8)]``.

    Raises:
        click.BadParameter: an unknown action, or a count that is not a whole number.
    """
    plan = []
    for token in (t.strip() for t in text.split(",") if t.strip()):
        name, _, count = token.partition(":")
        counted = name in ("steps", "fwdbwd", "profile")
        optional = name in ("measure", "by_module")  # measure:N, by_module:N: N repeats instead of --repeats
        if name not in ACTIONS or (counted != bool(count) and not optional) or not (count or "0").isdigit():
            raise click.BadParameter(f"bad action {token!r}: use measure[:N], by_module[:N], record, isolated, "
                                     "steps:N, fwdbwd:N, zero_grad, profile:N or rebuild", param_hint="--plan")
        plan.append((name, int(count or 0)))
    return plan


def rank_main(study: str, plan: list[tuple[str, int]], repeats: int, json_out: str | None) -> None:
    """Every rank: ``plan``'s actions; rank 0 prints (and writes ``json_out``)."""
    import torch
    import torch.distributed as dist

    from planner.artifacts.config import load_study_config
    from planner.artifacts.profile import OverlapTimings
    from planner.simulation.in_step import measured_slowdown
    from runtime.apply import model_fingerprint
    from runtime.collective_timer import collective_rounds
    from runtime.collectives import gather_objects
    from runtime.overlap_timer import overlap_timings
    from runtime.rank import init_rank, shutdown_rank
    from runtime.recorder import compute_unsharded, record_profile
    from runtime.torch_private import reshard_after_forward
    from runtime.workload import build_study_workload, forward_backward, fsdp_modules, train_step

    config = load_study_config(study)
    mesh = init_rank(config.launch.backend)
    device = mesh.device_type
    workload = build_study_workload(config.workload, mesh)
    modules = fsdp_modules(workload.model)
    fingerprint = model_fingerprint(workload.model, dist.get_world_size())
    numels = dict(zip(fingerprint.module_fqns, fingerprint.param_numels, strict=True))
    counter = iter(range(10**9))

    def timed_step() -> float:
        dist.barrier()
        start = time.perf_counter()
        train_step(workload, next(counter))
        if device == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        return (time.perf_counter() - start) * 1e3

    def profiled(cycles: int) -> None:
        schedule = torch.profiler.schedule(wait=1, warmup=1, active=1, repeat=cycles)
        with user_profiler(device, tempfile.mkdtemp(), schedule) as p:
            for _ in range(3 * cycles):
                train_step(workload, next(counter))
                p.step()

    rows = []
    since: list[str] = []
    for action, count in plan:
        if action not in ("measure", "by_module", "record"):
            since.append(f"{action}:{count}" if count else action)
        if action == "steps":
            for _ in range(count):
                train_step(workload, next(counter))
            continue
        if action == "profile":
            profiled(count)
            continue
        if action == "fwdbwd":
            for _ in range(count):
                forward_backward(workload, next(counter))
            continue
        if action == "zero_grad":
            workload.optimizer.zero_grad(set_to_none=True)
            continue
        if action == "isolated":
            compute_unsharded(workload, config.measure.profile_repeats, device,
                              {fqn: reshard_after_forward(m) for fqn, m in modules})
            continue
        if action == "rebuild":
            del workload, modules
            gc.collect()
            workload = build_study_workload(config.workload, mesh)
            modules = fsdp_modules(workload.model)
            continue
        label = " ".join(since) or ("(fresh)" if not rows else "(nothing)")
        since = []
        if action == "record":
            profile = record_profile(workload, warmup_steps=config.measure.warmup_steps, steps=config.measure.steps,
                                     repeats=config.measure.profile_repeats)
            rows.append({"before": f"{label}, then record",
                         "overlap_slowdown": measured_slowdown(profile.in_step.overlap) if profile.in_step.overlap
                         else None,
                         "all_gather_ms": {f: m.all_gather_ms for f, m in profile.modules.items()},
                         "reduce_scatter_ms": {f: m.reduce_scatter_ms for f, m in profile.modules.items()},
                         "step_ms": profile.measured_step_ms})
            continue
        faults = process_usage().faults
        times = count or repeats
        if action == "measure":
            figures = collective_rounds(modules, numels, times, device)
        else:
            figures = {fqn: collective_rounds(modules, {fqn: numels[fqn]}, times, device)[fqn] for fqn in numels}
        faults = process_usage().faults - faults
        ag = {fqn: values["all_gather_ms"] for fqn, values in figures.items()}
        rs = {fqn: values["reduce_scatter_ms"] for fqn, values in figures.items()}
        overlap = overlap_timings(modules, numels, ag, 10) if device != "cuda" else None
        steps = [timed_step() for _ in range(3)]
        local = {"ag": ag, "rs": rs, "step_ms": statistics.median(steps), "faults": faults, "overlap": overlap}
        gathered = gather_objects(local)
        rows.append({
            "before": f"{label}, then {action}" if action != "measure" else label,
            "repeats": count or repeats,
            "all_gather_ms": {f: max(r["ag"][f] for r in gathered) for f in ag},
            "reduce_scatter_ms": {f: max(r["rs"][f] for r in gathered) for f in rs},
            "step_ms": max(r["step_ms"] for r in gathered),
            "all_gather_minor_faults": max(r["faults"] for r in gathered),
            "overlap_slowdown": (statistics.fmean(measured_slowdown(OverlapTimings(**r["overlap"])) for r in gathered)
                                 if gathered[0]["overlap"] else None),
        })
    sizes = statistics.multimode(numels.values())
    run = {"study": config.name, "repeats": repeats, "rows": rows,
           "same_size": [fqn for fqn, n in numels.items() if n == sizes[0]] if len(sizes) == 1 else []}
    if dist.get_rank() == 0:
        report(run)
        if json_out:
            with open(json_out, "w") as f:
                json.dump(run, f, indent=1)
    shutdown_rank()


def spread(figures: dict[str, float], fqns: list[str]) -> float:
    """(max - min) / median of ``figures`` over ``fqns`` (modules of one size, which should read alike); NaN for
    fewer than two."""
    values = [figures[f] for f in fqns]
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else float("nan")


def report(run: dict) -> None:
    """Print a run: per measurement the sums of the collectives' medians and their ratios to the first, and the
    spread of the all-gathers and reduce-scatters over the modules of the most common size (the identical blocks)."""
    rows = run["rows"]
    first_ag = sum(rows[0]["all_gather_ms"].values())
    first_rs = sum(rows[0]["reduce_scatter_ms"].values())
    print(f"\n== {run['study']}: isolated collectives as the process runs ({run['repeats']} repeats a figure)")
    print(f"{'after':>32} {'sum AG ms':>10} {'/first':>7} {'sum RS ms':>10} {'/first':>7} {'step ms':>8} "
          f"{'AG faults':>10} {'overlap':>8} {'AG spread':>10} {'RS spread':>10}")
    same = run.get("same_size", [])
    for row in rows:
        ag, rs = sum(row["all_gather_ms"].values()), sum(row["reduce_scatter_ms"].values())
        print(f"{row['before']:>32} {ag:10.1f} {ag / first_ag:7.2f} {rs:10.1f} {rs / first_rs:7.2f} "
              f"{row['step_ms']:8.0f} {row.get('all_gather_minor_faults', '-'):>10} "
              f"{row['overlap_slowdown'] or float('nan'):8.2f} {spread(row['all_gather_ms'], same):10.2f} "
              f"{spread(row['reduce_scatter_ms'], same):10.2f}")


@click.command(help=__doc__)
@studies_argument
@click.option("--plan", default="steps:2,isolated,measure,steps:4,measure,record,steps:4,measure",
              show_default=True, help="actions, comma-separated: measure, by_module, steps:N, profile:N, rebuild, ...")
@click.option("--repeats", default=2, show_default=True, help="timed repeats of each collective (median)")
@saved_run_options
def main(studies: tuple[str, ...], plan: str, repeats: int, json_out: str | None, refit: tuple[str, ...]) -> None:
    if report_saved(refit, report):
        return
    actions = parse_plan(plan)
    run_studies(MODULE, studies or ("studies/llama-cpu.toml",),
                lambda study: [study, "--plan", plan, "--repeats", str(repeats), *json_flag(json_out)],
                lambda study: rank_main(study, actions, repeats, json_out))


if __name__ == "__main__":
    main()
