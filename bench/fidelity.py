"""Benchmark: simulator fidelity against the real ranks, before and after calibration.

    python -m bench.fidelity [studies/llama-cpu.toml studies/gpt2-cpu.toml] [--rounds 31] [--json out.json]
    python -m bench.fidelity --refit llama.json --refit gpt2.json   # saved runs, today's calibration, no ranks

For each study, in one run on its ranks: record a profile; build 15 plans
(:func:`fidelity_plans`: FSDP2's default; uniform depths 0-3 with and without async
unshard; three per-module plans spread over a simulated study; two
deliberately bad plans; no reshard after forward); measure them
interleaved; track the unsharded parameter bytes alive through FSDP's own
unshard/reshard for one step of each. Then, over 40 random half splits of
the plans, fit the calibration on one half and report on the held-back half
the prediction error and the Spearman rank correlation before and after
(median and quartiles over the splits: one split of 15 plans is too noisy an
estimate); leave-one-out (each plan predicted by a calibration fitted on all
the others) over every plan; the measurement's own noise (step-to-step
spread, and how well odd rounds and even rounds agree on the ranking: no
prediction can rank the plans better than the measurement does); the memory
error for all plans.
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from bench.ranks import as_tune_ranks, json_flag, report_saved, run_studies, saved_run_options, studies_argument

if TYPE_CHECKING:
    from planner.artifacts.plan import Plan
    from planner.artifacts.profile import Profile

MODULE = "bench.fidelity"


def fidelity_plans(profile: Profile) -> dict[str, Plan]:
    """The benchmark's plans, by name: the issue's set plus plans that move the step time the most.

    FSDP2's default; uniform depths 0-3 with and without async unshard; three
    per-module plans spread over a simulated study (its best, and those at a
    third and two thirds of its distinct plans ranked by predicted time); two
    deliberately bad plans (re-all-gather the previous module in every
    pre-forward: memory; re-all-gather a module whose backward already ran in
    every pre-backward: communication); no reshard after forward (one
    all-gather per module less), sync and with forward prefetch 1 async.
    """
    import optuna

    from planner.artifacts.config import StudyConfig
    from planner.artifacts.plan import Plan
    from planner.simulation.parameters import simulator_for
    from planner.study import distinct_plans, simulated_stage
    from search_spaces import get_space, uniform

    default = Plan.default(profile)
    plans = {"FSDP2 default": default}
    for d in range(4):
        for a in (False, True):
            if (d, a) != (0, False):
                plan = uniform.build(profile, d, max(1, d)).with_knobs(unshard_async_op=a)
                plans[f"uniform depth {d}{' async' if a else ''}"] = plan
    config = StudyConfig.build(name="fidelity", storage="sqlite://", factory="-", space="per_module",
                               sampler="nsga2", sim_trials=300, seed=1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = get_space("per_module")
    sim = simulated_stage(simulator_for(profile), config, optuna.storages.InMemoryStorage(), space,
                          show_progress_bar=False)
    seen = {p.behaviour_key() for p in plans.values()}
    ranked = [plan for _, plan in distinct_plans(sim, profile, space) if plan.behaviour_key() not in seen]
    for label, index in (("best", 0), ("1/3", len(ranked) // 3), ("2/3", 2 * len(ranked) // 3)):
        if ranked:
            plans[f"per-module {label} of {len(ranked)}"] = ranked[min(index, len(ranked) - 1)]
    order = list(dict.fromkeys(profile.pre_forward_order))
    post = [f for f in dict.fromkeys(profile.post_forward_order) if f != profile.root_fqn]
    forward_bad = {
        f: dataclasses.replace(m, forward_prefetch=(order[order.index(f) - 1],) if order.index(f) > 1 else ())
        for f, m in default.modules.items()
    }
    plans["bad: re-gather the previous module"] = dataclasses.replace(default, modules=forward_bad)
    # Backward runs in reverse post-forward order: post[i + 1] has finished its backward when post[i] starts.
    backward_bad = dict(default.modules)
    for i, f in enumerate(post[:-1]):
        backward_bad[f] = dataclasses.replace(default.modules[f], backward_prefetch=(post[i + 1],))
    plans["bad: re-gather a finished module"] = dataclasses.replace(default, modules=backward_bad)

    plans["no reshard after forward"] = without_reshard(profile, default)
    async_1 = uniform.build(profile, 1, 1).with_knobs(unshard_async_op=True)
    plans["no reshard after forward, prefetch 1 async"] = without_reshard(profile, async_1)
    return plans


def without_reshard(profile: Profile, plan: Plan) -> Plan:
    """``plan`` with every block keeping its parameters unsharded after forward (the root always does)."""
    return dataclasses.replace(plan, modules={
        f: m if f == profile.root_fqn else dataclasses.replace(m, reshard_after_forward=False)
        for f, m in plan.modules.items()})


def collectives_after_passes(workload, profile: Profile, repeats: int) -> Profile:
    """``profile`` with its collectives and overlap timings timed again just after the isolated compute passes, the
    recorder's earlier order ([Note: The collectives are timed before the isolated passes] in
    ``runtime/recording/isolated.py``); all ranks call it. Max across ranks, as the recorder consolidates (the overlap
    timings: mean)."""
    from planner.artifacts.profile import OverlapTimings
    from runtime.ranks.collectives import gather_objects
    from runtime.ranks.torch_private import reshard_after_forward
    from runtime.recording.collective_timer import module_collectives
    from runtime.recording.isolated import isolated_measurements
    from runtime.timing import device_type_of
    from runtime.workload import fsdp_modules

    modules = fsdp_modules(workload.model)
    device = device_type_of(workload)
    resharding = {fqn: reshard_after_forward(m) for fqn, m in modules}
    isolated_measurements(workload, profile.fingerprint, repeats, device, resharding, collectives=False)
    per_rank = gather_objects(module_collectives(modules, profile.fingerprint, repeats, device))
    modules_after = {fqn: dataclasses.replace(
        m, all_gather_ms=max(r[0][fqn].all_gather_ms for r in per_rank),
        reduce_scatter_ms=max(r[0][fqn].reduce_scatter_ms for r in per_rank)) for fqn, m in profile.modules.items()}
    overlap = profile.in_step.overlap
    if overlap is not None and per_rank[0][1] is not None:
        overlap = OverlapTimings(per_rank[0][1].module, **{
            k: statistics.fmean(getattr(r[1], k) for r in per_rank)
            for k in ("all_gather_ms", "compute_ms", "overlapped_ms")})
    return dataclasses.replace(profile, modules=modules_after,
                               in_step=dataclasses.replace(profile.in_step, overlap=overlap))


def _round_lines(plans: int, shown: bool) -> Callable[[], None]:
    """A progress callback per step that prints a line per round (``shown``: rank 0): where a long run is, and how
    fast steps go."""
    started, done = time.perf_counter(), [0]

    def progress() -> None:
        done[0] += 1
        if shown and done[0] % plans == 0:
            print(f"  {done[0]} steps ({done[0] // plans} rounds incl. warm-up), {time.perf_counter() - started:.0f} s",
                  flush=True)

    return progress


def rank_main(study: str, rounds: int, out: str | None, after_passes: bool = False, only: bool = False) -> None:
    """Every rank: record (and, ``after_passes``, the collectives again after the isolated passes), measure the
    plans interleaved and their unsharded bytes; rank 0 reports (``only``: the uncalibrated line alone)."""
    import torch.distributed as dist

    from planner.artifacts.config import load_study_config
    from runtime.apply import configure_plan
    from runtime.measuring.measure import measure_plans
    from runtime.ranks.collectives import gather_max
    from runtime.ranks.rank import job_rank
    from runtime.recording.memory import UnshardedBytesTracker
    from runtime.recording.recorder import record_profile
    from runtime.recording.steps import WorkloadSteps
    from runtime.workload import build_study_workload, train_step

    as_tune_ranks()
    config = load_study_config(study)
    with job_rank(config.launch) as rank:
        mesh = rank.mesh
        workload = build_study_workload(config.workload, mesh)
        profile = record_profile(
            workload, warmup_steps=1, steps=config.measure.steps, repeats=config.measure.profile_repeats
        )
        variant = collectives_after_passes(workload, profile, config.measure.profile_repeats) if after_passes else None
        plans = fidelity_plans(profile)
        names = list(plans)
        runner = WorkloadSteps(workload, [plans[n] for n in names])
        progress = _round_lines(len(names), dist.get_rank() == 0)
        step_ms = measure_plans(runner, [list(range(len(names)))] * rounds, 1, progress)
        peaks = []
        for n in names:
            configure_plan(workload.model, plans[n], check=False)
            with UnshardedBytesTracker() as tracker:
                train_step(workload, 0)
            peaks.append(tracker.peak_bytes)
        peaks, _ = gather_max(peaks)
        if dist.get_rank() == 0:
            run = {"study": config.name, "rounds": rounds, "profile": profile.to_dict(),
                   "profile_collectives_after_passes": variant.to_dict() if variant else None,
                   "rows": [{"plan": n, "plan_json": plans[n].to_dict(), "steps_ms": t, "measured_unsharded_bytes": b}
                            for n, t, b in zip(names, step_ms, peaks, strict=True)]}
            if out:  # first: the report's calibration fits take minutes, and the measurements are what took the ranks
                Path(out).write_text(json.dumps(run, indent=1))
            if only:  # the uncalibrated line alone; the calibration fits left to --refit on the JSON
                print(f"\n{config.name}, {len(names)} plans x {rounds} rounds, uncalibrated: "
                      f"{_errors(profile, [plans[n] for n in names], step_ms)}")
            else:
                report(run)
        del workload
        rank.ended = True


def _splits(plans: list[Plan], count: int = 40, seed: int = 0) -> list[set[int]]:
    """``count`` distinct random half splits (seeded): the indices each calibration is fitted on.

    Every split has sync and async plans on both sides (the calibration's
    overlap parameter is fitted only from async plans). One split of 15 plans
    is a noisy estimate (which 8 plans are held back moves the held-back
    Spearman by +-0.3 on the same measurements), so the report summarizes
    many: repeated random sub-sampling validation.
    """
    rng = random.Random(seed)
    n = len(plans)
    splits: list[set[int]] = []
    tries = 0
    while len(splits) < count and tries < 100 * count:
        tries += 1
        train = set(rng.sample(range(n), n // 2))
        kinds = [{p.unshard_async_op for i, p in enumerate(plans) if (i in train) == side} for side in (True, False)]
        if kinds[0] == kinds[1] == {False, True} and train not in splits:
            splits.append(train)
    return splits


def _quartiles(values: list[float], fmt: str) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return f"{fmt.format(q[1])} (quartiles {fmt.format(q[0])}-{fmt.format(q[2])})"


def _errors(profile: Profile, plans: list[Plan], steps: list[list[float]]) -> str:
    """One profile's uncalibrated predictions of ``plans`` against their measured steps (ms, per plan one a round,
    ``plans[0]`` FSDP2's default): the sums of its collectives, its in-step parameters, the median (max) |error|
    against each plan's median step, and the median (max) |error| of each other plan's predicted ratio to the
    default against its measured one, the median of its per-round ratios (the default's offset, and each round's
    level, drop out); last, the default's own error, the level the first figure carries into every plan."""
    from planner.simulation.in_step import in_step_params
    from planner.simulation.parameters import simulate

    predicted = [simulate(profile, p).step_ms for p in plans]
    errors = [100 * abs(p / statistics.median(t) - 1) for p, t in zip(predicted, steps, strict=True)]
    relative = [100 * abs((p / predicted[0]) / statistics.median(a / b for a, b in zip(t, steps[0], strict=True)) - 1)
                for p, t in zip(predicted[1:], steps[1:], strict=True)]
    params, level = in_step_params(profile), predicted[0] / statistics.median(steps[0]) - 1
    return (f"all-gathers {sum(m.all_gather_ms for m in profile.modules.values()):.0f} ms, reduce-scatters "
            f"{sum(m.reduce_scatter_ms for m in profile.modules.values()):.0f} ms, comm_scale "
            f"{params.comm_scale:.2f}, overlap_slowdown {params.overlap_slowdown:.2f}; median |error| "
            f"{statistics.median(errors):.1f}% (max {max(errors):.1f}%), relative to the default "
            f"{statistics.median(relative):.1f}% (max {max(relative):.1f}%); the default's level {100 * level:+.1f}% "
            f"({predicted[0]:.0f} ms predicted, {statistics.median(steps[0]):.0f} measured)")


def report(run: dict, splits: int = 40) -> None:
    """Fit, predict and print one run (measured now, or saved with ``--json``); adds the figures to ``run``.

    ``run``: ``study``, ``profile`` (dict), ``rows`` (each ``plan`` name,
    ``plan_json``, ``steps_ms`` (max across ranks per step, ms),
    ``measured_unsharded_bytes``). Prints per plan the measured median, the
    uncalibrated prediction and the leave-one-out calibrated one (a
    calibration fitted on the other plans); then, over ``splits`` random half
    splits, the held-back plans' median |error| and Spearman before and after
    a calibration fitted on the other half; the measurement's own noise;
    the memory error.
    """
    from planner.artifacts.plan import Plan
    from planner.artifacts.profile import Profile
    from planner.simulation.calibrate import Observation, calibrated, fit, spearman, summary
    from planner.simulation.parameters import simulate

    profile = dataclasses.replace(Profile.from_dict(run["profile"]), calibration=None)
    rows = run["rows"]
    plans = [Plan.from_dict(r["plan_json"]) for r in rows]
    steps = [r["steps_ms"] for r in rows]
    measured = [statistics.median(t) for t in steps]
    obs = [Observation(p, m) for p, m in zip(plans, measured, strict=True)]
    raw = [simulate(profile, p) for p in plans]
    before = [100 * (r.step_ms - m) / m for r, m in zip(raw, measured, strict=True)]
    # Leave-one-out: every plan predicted by a calibration fitted on all the others.
    loo = [simulate(calibrated(profile, fit(profile, obs[:i] + obs[i + 1:])), o.plan).step_ms
           for i, o in enumerate(obs)]
    loo_err = [100 * (p - m) / m for p, m in zip(loo, measured, strict=True)]
    cal_all = calibrated(profile, fit(profile, obs))
    print(f"\n{run['study']}: {len(rows)} plans x {len(steps[0])} rounds interleaved; calibration fitted on all "
          "plans: " + ", ".join(f"{k} {v:.3g}" for k, v in cal_all.calibration.items()))
    print(f"{'plan':<44} {'measured':>9} {'predicted':>9} {'err %':>7} {'calibr.':>9} {'err %':>7} "
          f"{'unsharded MiB meas/pred':>24}")
    for r, m, res, e, c, ce in zip(rows, measured, raw, before, loo, loo_err, strict=True):
        peak = r["measured_unsharded_bytes"]
        mem_err = 100 * (res.peak_unsharded_bytes - peak) / peak if peak else float("nan")
        r.update(measured_ms=m, predicted_ms=res.step_ms, error_pct=e, loo_predicted_ms=c, loo_error_pct=ce,
                 predicted_unsharded_bytes=res.peak_unsharded_bytes, memory_error_pct=mem_err)
        print(f"{r['plan']:<44} {m:>9.1f} {res.step_ms:>9.1f} {e:>+7.1f} {c:>9.1f} {ce:>+7.1f} "
              f"{peak / 2**20:>11.1f} / {res.peak_unsharded_bytes / 2**20:<10.1f}")
    print("('calibr.': leave-one-out, each plan predicted by a calibration fitted on the other plans)")
    print(f"uncalibrated: {_errors(profile, plans, steps)}")
    if run.get("profile_collectives_after_passes"):  # the same measurements, two recorders: a paired comparison
        for label, p in (("collectives timed after a step (the recorder)", profile),
                         ("collectives timed after the isolated passes", dataclasses.replace(
                             Profile.from_dict(run["profile_collectives_after_passes"]), calibration=None))):
            print(f"uncalibrated, {label}: {_errors(p, plans, steps)}")
    held_runs = []
    for train_idx in _splits(plans, splits):
        held = [i for i in range(len(obs)) if i not in train_idx]
        cal = calibrated(profile, fit(profile, [obs[i] for i in sorted(train_idx)]))
        pred = [simulate(cal, plans[i]).step_ms for i in held]
        hm = [measured[i] for i in held]
        after = [abs(100 * (p - m) / m) for p, m in zip(pred, hm, strict=True)]
        held_runs.append({
            "fit": sorted(train_idx), "calibration": cal.calibration,
            "error_before": statistics.median(abs(before[i]) for i in held),
            "error_after": statistics.median(after), "max_error_after": max(after),
            "spearman_before": spearman([raw[i].step_ms for i in held], hm),
            "spearman_after": spearman(pred, hm),
        })
    # The measurement's own ranking noise: odd rounds against even rounds, and the step-to-step spread.
    split_half = spearman([statistics.median(t[0::2]) for t in steps], [statistics.median(t[1::2]) for t in steps])
    quartiles = [statistics.quantiles(t, n=4) for t in steps]
    spread = [100 * (q[2] - q[0]) / m for q, m in zip(quartiles, measured, strict=True)]
    mem = [abs(r["memory_error_pct"]) for r in rows]

    def over(key):
        return [h[key] for h in held_runs if h[key] == h[key]]  # nan: a constant side, no rank correlation

    loo_rho = spearman(loo, measured)
    run.update(calibration=cal_all.calibration, held_splits=held_runs, loo_spearman=loo_rho,
               split_half_spearman=split_half,
               held_median_error_pct=statistics.median(over("error_after")),
               held_median_spearman=statistics.median(over("spearman_after")))
    n_held = len(obs) - len(obs) // 2
    print(f"held-back plans, {len(held_runs)} random half splits (calibration fitted on {len(obs) // 2} plans, "
          f"{n_held} held back), median over splits:")
    print(f"  before calibration: median |error| {_quartiles(over('error_before'), '{:.1f}%')}, "
          f"Spearman {_quartiles(over('spearman_before'), '{:.2f}')}")
    print(f"  after calibration:  median |error| {_quartiles(over('error_after'), '{:.1f}%')}, "
          f"max |error| {_quartiles(over('max_error_after'), '{:.1f}%')}, "
          f"Spearman {_quartiles(over('spearman_after'), '{:.2f}')}")
    print(f"leave-one-out (each plan held back from its own fit, all {len(obs)} plans): {summary(loo_err)}, "
          f"Spearman {loo_rho:.2f}")
    print(f"all plans: before {summary(before)}, Spearman {spearman([r.step_ms for r in raw], measured):.2f}")
    print(f"measurement noise: step-to-step interquartile range, median over plans {statistics.median(spread):.1f}% "
          f"of the step time; odd rounds vs even rounds rank the plans with Spearman {split_half:.2f}")
    print(f"unsharded parameter memory: median |error| {statistics.median(mem):.1f}%, max {max(mem):.1f}%")


@click.command(help=__doc__)
@studies_argument
@click.option("--rounds", default=31, show_default=True,
              help="interleaved rounds, one step of every plan each (about 30 minutes per study at 31 on the 2-core "
                   "CPU testbed)")
@click.option("--collectives-after-passes", "after_passes", is_flag=True,
              help="also time the collectives again just after the isolated passes (the recorder's earlier "
                   "order) and compare both profiles' uncalibrated predictions of the same measured plans")
@click.option("--measure-only", is_flag=True, help="print the uncalibrated errors alone (the fits: --refit on --json)")
@saved_run_options
def main(studies: tuple[str, ...], rounds: int, after_passes: bool, measure_only: bool, json_out: str | None,
         refit: tuple[str, ...]) -> None:
    if report_saved(refit, report):
        return
    run_studies(MODULE, studies, lambda study: [study, "--rounds", str(rounds)] + json_flag(json_out)
                + ["--collectives-after-passes"] * after_passes + ["--measure-only"] * measure_only,
                lambda study: rank_main(study, rounds, json_out, after_passes, measure_only))


if __name__ == "__main__":
    main()
