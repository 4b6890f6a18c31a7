"""Benchmark: simulator fidelity against the real ranks, before and after calibration.

    python bench/fidelity.py [studies/llama-cpu.toml studies/gpt2-cpu.toml] [--rounds 9] [--json out.json]
    python bench/fidelity.py --refit llama.json gpt2.json   # saved runs, today's calibration, no ranks

For each study, in one run on its ranks: record a profile; build 15 plans
(:func:`_plans`: FSDP2's default; uniform depths 0-3 with and without async
unshard; three per-module plans spread over a simulated study; two
deliberately bad plans; no reshard after forward); measure them
interleaved; track the unsharded parameter bytes alive through FSDP's own
unshard/reshard for one step of each. Then fit the calibration on half of the
plans and report, on the held-back half, the prediction error and the
Spearman rank correlation before and after; then leave-one-out (each plan
predicted by a calibration fitted on all the others) over every plan; the
measurement's own noise (step-to-step spread, and how well odd rounds and even
rounds agree on the ranking: no prediction can rank the plans better than the
measurement does); the memory error for all plans.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.errors import PlannerError  # noqa: E402


def _plans(profile):
    """The benchmark's plans, by name: the issue's set plus plans that move the step time the most.

    FSDP2's default; uniform depths 0-3 with and without async unshard; three
    per-module plans spread over a simulated study (its best, and those at a
    third and two thirds of its distinct plans ranked by predicted time); two
    deliberately bad plans (re-all-gather the previous module in every
    pre-forward: memory; re-all-gather a module whose backward already ran in
    every pre-backward: communication); no reshard after forward (one
    all-gather per module less), sync and with forward prefetch 1 async.
    """
    import dataclasses

    import optuna

    from planner.config import StudyConfig
    from planner.plan import Plan
    from planner.study import select_candidates, simulated_stage
    from search_spaces import uniform

    default = Plan.default(profile)
    plans = {"FSDP2 default": default}
    for d in range(4):
        for a in (False, True):
            if (d, a) != (0, False):
                plans[f"uniform depth {d}{' async' if a else ''}"] = uniform.build(profile, d, max(1, d), a)
    config = StudyConfig(name="fidelity", storage="sqlite://", factory="-", space="per_module", sampler="nsga2",
                         sim_trials=300, seed=1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sim = simulated_stage(profile, config, optuna.storages.InMemoryStorage(), show_progress_bar=False)
    seen = {p.behaviour_key() for p in plans.values()}
    ranked = [c.plan for c in select_candidates(sim, profile, "per_module", 300)[1:]
              if c.plan.behaviour_key() not in seen]
    for label, index in (("best", 0), ("1/3", len(ranked) // 3), ("2/3", 2 * len(ranked) // 3)):
        if ranked:
            plans[f"per-module {label} of {len(ranked)}"] = ranked[min(index, len(ranked) - 1)]
    order = list(dict.fromkeys(profile.pre_forward_order))
    post = [f for f in dict.fromkeys(profile.post_forward_order) if f != profile.root_fqn]
    forward_bad = {f: dataclasses.replace(m, forward_prefetch=(order[order.index(f) - 1],) if order.index(f) > 1 else ())
                   for f, m in default.modules.items()}
    plans["bad: re-gather the previous module"] = dataclasses.replace(default, modules=forward_bad)
    # Backward runs in reverse post-forward order: post[i + 1] has finished its backward when post[i] starts.
    backward_bad = dict(default.modules)
    for i, f in enumerate(post[:-1]):
        backward_bad[f] = dataclasses.replace(default.modules[f], backward_prefetch=(post[i + 1],))
    plans["bad: re-gather a finished module"] = dataclasses.replace(default, modules=backward_bad)
    def without_reshard(plan):  # every block keeps its parameters after forward (the root always does)
        return dataclasses.replace(plan, modules={
            f: m if f == profile.root_fqn else dataclasses.replace(m, reshard_after_forward=False)
            for f, m in plan.modules.items()})

    plans["no reshard after forward"] = without_reshard(default)
    plans["no reshard after forward, prefetch 1 async"] = without_reshard(uniform.build(profile, 1, 1, True))
    return plans


def rank_main(study: str, rounds: int, out: str | None) -> None:
    import torch.distributed as dist

    from planner.config import load_study_config
    from runtime.apply import apply_plan
    from runtime.launch import init_rank, shutdown_rank
    from runtime.measure import max_across_ranks, measure_plans
    from runtime.memory import UnshardedBytesTracker
    from runtime.recorder import record_profile
    from runtime.workload import build_workload, train_step

    config = load_study_config(study)
    mesh = init_rank(config.backend)
    workload = build_workload(config.factory, mesh, config.kwargs)
    profile = record_profile(workload, warmup_steps=1, steps=config.steps, repeats=config.profile_repeats)
    plans = _plans(profile)
    names = list(plans)
    step_ms, _ = measure_plans(workload, [plans[n] for n in names], rounds, warmup_steps=1)
    peaks = []
    for n in names:
        apply_plan(workload.model, plans[n], check=False)
        with UnshardedBytesTracker() as tracker:
            train_step(workload, 0)
        peaks.append(tracker.peak_bytes)
    peaks, _ = max_across_ranks(peaks)
    if dist.get_rank() == 0:
        run = {"study": config.name, "rounds": rounds, "profile": profile.to_dict(),
               "rows": [{"plan": n, "plan_json": plans[n].to_dict(), "steps_ms": t, "measured_unsharded_bytes": b}
                        for n, t, b in zip(names, step_ms, peaks)]}
        report(run)
        if out:
            Path(out).write_text(json.dumps(run, indent=1))
    del workload
    shutdown_rank()


def _split(plans) -> set[int]:
    """Indices of the plans the calibration is fitted on: a seeded half, with sync and async plans on both sides."""
    rng = random.Random(0)
    while True:
        train = set(rng.sample(range(len(plans)), len(plans) // 2))
        kinds = [{p.unshard_async_op for i, p in enumerate(plans) if (i in train) == side} for side in (True, False)]
        if kinds[0] == kinds[1] == {False, True}:
            return train


def report(run: dict) -> None:
    """Fit, predict and print one run (measured now, or saved with ``--json``); adds the figures to ``run``.

    ``run``: ``study``, ``profile`` (dict), ``rows`` (each ``plan`` name,
    ``plan_json``, ``steps_ms`` (max across ranks per step, ms),
    ``measured_unsharded_bytes``).
    """
    import dataclasses

    from planner.calibrate import Observation, calibrated, errors_pct, fit, spearman, summary
    from planner.plan import Plan
    from planner.profile import Profile
    from planner.simulator import simulate

    profile = dataclasses.replace(Profile.from_dict(run["profile"]), calibration=None)
    rows = run["rows"]
    plans = [Plan.from_dict(r["plan_json"]) for r in rows]
    steps = [r["steps_ms"] for r in rows]
    measured = [statistics.median(t) for t in steps]
    obs = [Observation(p, m) for p, m in zip(plans, measured)]
    train_idx = _split(plans)
    train = [o for i, o in enumerate(obs) if i in train_idx]
    held = [o for i, o in enumerate(obs) if i not in train_idx]
    cal = calibrated(profile, fit(profile, train))
    before, after = errors_pct(profile, obs), errors_pct(cal, obs)
    print(f"\n{run['study']}: {len(rows)} plans x {len(steps[0])} rounds interleaved; calibration fitted on the "
          f"{len(train)} plans marked 'fit': " + ", ".join(f"{k} {v:.3g}" for k, v in cal.calibration.items()))
    print(f"{'plan':<38} {'set':<5} {'measured':>9} {'predicted':>9} {'err %':>7} {'calibr.':>9} {'err %':>7} "
          f"{'unsharded MiB meas/pred':>24}")
    for i, (r, p) in enumerate(zip(rows, plans)):
        raw, c = simulate(profile, p), simulate(cal, p)
        peak = r["measured_unsharded_bytes"]
        mem_err = 100 * (raw.peak_unsharded_bytes - peak) / peak if peak else float("nan")
        r.update(fit=i in train_idx, measured_ms=measured[i], predicted_ms=raw.step_ms, error_pct=before[i],
                 calibrated_ms=c.step_ms, calibrated_error_pct=after[i],
                 predicted_unsharded_bytes=raw.peak_unsharded_bytes, memory_error_pct=mem_err)
        print(f"{r['plan']:<38} {'fit' if i in train_idx else 'held':<5} {measured[i]:>9.1f} {raw.step_ms:>9.1f} "
              f"{before[i]:>+7.1f} {c.step_ms:>9.1f} {after[i]:>+7.1f} "
              f"{peak / 2**20:>11.1f} / {raw.peak_unsharded_bytes / 2**20:<10.1f}")
    hm = [o.measured_ms for o in held]
    rho_before = spearman([simulate(profile, o.plan).step_ms for o in held], hm)
    rho_after = spearman([simulate(cal, o.plan).step_ms for o in held], hm)
    # Leave-one-out: every plan predicted by a calibration fitted on all the others.
    loo = [simulate(calibrated(profile, fit(profile, obs[:i] + obs[i + 1:])), o.plan).step_ms
           for i, o in enumerate(obs)]
    loo_err = [100 * (p - m) / m for p, m in zip(loo, measured)]
    for r, p_ms, e in zip(rows, loo, loo_err):
        r["loo_predicted_ms"], r["loo_error_pct"] = p_ms, e
    # The measurement's own ranking noise: odd rounds against even rounds, and the step-to-step spread.
    split_half = spearman([statistics.median(t[0::2]) for t in steps], [statistics.median(t[1::2]) for t in steps])
    quartiles = [statistics.quantiles(t, n=4) for t in steps]
    spread = [100 * (q[2] - q[0]) / m for q, m in zip(quartiles, measured)]
    mem = [abs(r["memory_error_pct"]) for r in rows]
    run.update(calibration=cal.calibration, held_spearman=[rho_before, rho_after], loo_spearman=spearman(loo, measured),
               split_half_spearman=split_half)
    print(f"held-back plans ({len(held)}): before calibration {summary(errors_pct(profile, held))}, Spearman "
          f"{rho_before:.2f}; after {summary(errors_pct(cal, held))}, Spearman {rho_after:.2f}")
    print(f"leave-one-out (each plan held back from its own fit, all {len(obs)} plans): {summary(loo_err)}, "
          f"Spearman {spearman(loo, measured):.2f}")
    print(f"all plans: before {summary(before)}, Spearman {spearman([r['predicted_ms'] for r in rows], measured):.2f}; "
          f"after {summary(after)}, Spearman {spearman([r['calibrated_ms'] for r in rows], measured):.2f}")
    print(f"measurement noise: step-to-step interquartile range, median over plans {statistics.median(spread):.1f}% "
          f"of the step time; odd rounds vs even rounds rank the plans with Spearman {split_half:.2f}")
    print(f"unsharded parameter memory: median |error| {statistics.median(mem):.1f}%, max {max(mem):.1f}%")


def refit(path: str) -> None:
    """Report a saved run (``--json``) again with today's plans split and calibration code, measuring nothing."""
    report(json.loads(Path(path).read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("studies", nargs="*", default=["studies/llama-cpu.toml", "studies/gpt2-cpu.toml"])
    parser.add_argument("--rounds", type=int, default=9,
                        help="interleaved rounds (one step of every plan each; about 10 minutes per study at 9 here)")
    parser.add_argument("--json", help="write the rows of the (single) study here")
    parser.add_argument("--refit", nargs="+", metavar="JSON", help="report saved --json runs again, measuring nothing")
    args = parser.parse_args()
    if args.refit:
        for path in args.refit:
            refit(path)
        return
    try:
        from planner.config import load_study_config
        from runtime.launch import in_torchrun, launch_ranks

        if in_torchrun():
            rank_main(args.studies[0], args.rounds, args.json)
            return
        for study in args.studies:
            config = load_study_config(study)
            forward = [study, "--rounds", str(args.rounds)] + (["--json", args.json] if args.json else [])
            code = launch_ranks(forward, config.nproc_per_node, script=__file__)
            if code:
                sys.exit(code)
    except PlannerError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
