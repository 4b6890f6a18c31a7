"""Benchmark: simulator fidelity against the real ranks, before and after calibration.

    python bench/fidelity.py [studies/llama-cpu.toml studies/gpt2-cpu.toml] [--rounds 5] [--json out.json]
    python bench/fidelity.py --refit llama.json gpt2.json   # saved runs, today's calibration, no ranks

For each study, in one run on its ranks: record a profile; build 12 plans
(FSDP2's default; uniform depths 0-3 with and without async unshard; the two
best per-module plans of a simulated study; a deliberately bad plan that
re-all-gathers the previous module in every pre-forward); measure them
interleaved; track the unsharded parameter bytes alive through FSDP's own
unshard/reshard for one step of each. Then fit the calibration on half of the
plans and report, on the held-back half, the prediction error and the
Spearman rank correlation before and after; then leave-one-out (each plan
predicted by a calibration fitted on all the others) over every plan, and the
step-to-step noise; the memory error for all plans.
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
    import dataclasses

    import optuna

    from planner.config import StudyConfig
    from planner.plan import Plan
    from planner.study import select_candidates, simulated_stage
    from search_spaces import uniform

    plans = {"FSDP2 default": Plan.default(profile)}
    for d in range(4):
        for a in (False, True):
            if (d, a) != (0, False):
                plans[f"uniform depth {d}{' async' if a else ''}"] = uniform.build(profile, d, max(1, d), a)
    config = StudyConfig(name="fidelity", storage="sqlite://", factory="-", space="per_module", sampler="nsga2",
                         sim_trials=300, seed=1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sim = simulated_stage(profile, config, optuna.storages.InMemoryStorage(), show_progress_bar=False)
    seen = {p.behaviour_key() for p in plans.values()}
    for c in select_candidates(sim, profile, "per_module", 10)[1:]:
        if c.plan.behaviour_key() not in seen and len(plans) < 11:
            seen.add(c.plan.behaviour_key())
            plans[f"per-module #{len(plans) - 7}"] = c.plan
    order = list(dict.fromkeys(profile.pre_forward_order))
    default = Plan.default(profile)
    bad = {f: dataclasses.replace(m, forward_prefetch=(order[order.index(f) - 1],) if order.index(f) > 1 else ())
           for f, m in default.modules.items()}
    plans["bad: re-gather the previous module"] = dataclasses.replace(default, modules=bad)
    return plans


def rank_main(study: str, rounds: int, out: str | None) -> None:
    import torch.distributed as dist

    from planner.calibrate import Observation, calibrated, errors_pct, fit, spearman, summary
    from planner.config import load_study_config
    from planner.simulator import simulate
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
        measured = [statistics.median(t) for t in step_ms]
        obs = [Observation(plans[n], m) for n, m in zip(names, measured)]
        rng = random.Random(0)
        while True:  # half for fitting, half held back; both halves with sync and async plans
            train_idx = set(rng.sample(range(len(obs)), len(obs) // 2))
            kinds = [{obs[i].plan.unshard_async_op for i in range(len(obs)) if (i in train_idx) == side}
                     for side in (True, False)]
            if kinds[0] == kinds[1] == {False, True}:
                break
        train = [o for i, o in enumerate(obs) if i in train_idx]
        held = [o for i, o in enumerate(obs) if i not in train_idx]
        params = fit(profile, train)
        cal = calibrated(profile, params)
        before, after = errors_pct(profile, obs), errors_pct(cal, obs)
        rows = []
        print(f"\n{config.name}: {len(names)} plans x {rounds} rounds interleaved; calibration fitted on the "
              f"{len(train)} plans marked 'fit': " + ", ".join(f"{k} {v:.3g}" for k, v in cal.calibration.items()))
        print(f"{'plan':<38} {'set':<5} {'measured':>9} {'predicted':>9} {'err %':>7} {'calibr.':>9} {'err %':>7} "
              f"{'unsharded MiB meas/pred':>24}")
        for i, n in enumerate(names):
            raw, c = simulate(profile, plans[n]), simulate(cal, plans[n])
            mem_err = 100 * (raw.peak_unsharded_bytes - peaks[i]) / peaks[i] if peaks[i] else float("nan")
            rows.append({"plan": n, "plan_json": plans[n].to_dict(), "fit": i in train_idx, "measured_ms": measured[i], "steps_ms": step_ms[i],
                         "predicted_ms": raw.step_ms, "error_pct": before[i], "calibrated_ms": c.step_ms,
                         "calibrated_error_pct": after[i], "measured_unsharded_bytes": peaks[i],
                         "predicted_unsharded_bytes": raw.peak_unsharded_bytes, "memory_error_pct": mem_err})
            print(f"{n:<38} {'fit' if i in train_idx else 'held':<5} {measured[i]:>9.1f} {raw.step_ms:>9.1f} "
                  f"{before[i]:>+7.1f} {c.step_ms:>9.1f} {after[i]:>+7.1f} "
                  f"{peaks[i] / 2**20:>11.1f} / {raw.peak_unsharded_bytes / 2**20:<10.1f}")
        h_before, h_after = errors_pct(profile, held), errors_pct(cal, held)
        hm = [o.measured_ms for o in held]
        rho_before = spearman([simulate(profile, o.plan).step_ms for o in held], hm)
        rho_after = spearman([simulate(cal, o.plan).step_ms for o in held], hm)
        # Leave-one-out: every plan predicted by a calibration fitted on the 11 others.
        loo = [simulate(calibrated(profile, fit(profile, obs[:i] + obs[i + 1:])), o.plan).step_ms
               for i, o in enumerate(obs)]
        loo_err = [100 * (p - m) / m for p, m in zip(loo, measured)]
        spread = [100 * (statistics.quantiles(t, n=4)[2] - statistics.quantiles(t, n=4)[0]) / statistics.median(t)
                  for t in step_ms]
        print(f"leave-one-out (each plan held back from its own fit, all {len(obs)} plans): {summary(loo_err)}, "
              f"Spearman {spearman(loo, measured):.2f}")
        print(f"measurement noise: step-to-step interquartile range, median over plans {statistics.median(spread):.1f}% "
              f"of the step time")
        for r, p_ms, e in zip(rows, loo, loo_err):
            r["loo_predicted_ms"], r["loo_error_pct"] = p_ms, e
        mem = [abs(r["memory_error_pct"]) for r in rows]
        print(f"held-back plans ({len(held)}): before calibration {summary(h_before)}, Spearman {rho_before:.2f}; "
              f"after {summary(h_after)}, Spearman {rho_after:.2f}")
        print(f"all plans: before {summary(before)}, Spearman {spearman([r['predicted_ms'] for r in rows], measured):.2f}; "
              f"after {summary(after)}, Spearman {spearman([r['calibrated_ms'] for r in rows], measured):.2f}")
        print(f"unsharded parameter memory: median |error| {statistics.median(mem):.1f}%, max {max(mem):.1f}%")
        if out:
            Path(out).write_text(json.dumps({"study": config.name, "profile": profile.to_dict(),
                                             "calibration": cal.calibration, "rows": rows,
                                             "held_spearman": [rho_before, rho_after],
                                             "loo_spearman": spearman(loo, measured)}, indent=1))
    del workload
    shutdown_rank()


def refit(path: str) -> None:
    """Report a saved run (``--json``) again with today's calibration code: no ranks, no new measurement."""
    from planner.calibrate import Observation, calibrated, errors_pct, fit, spearman, summary
    from planner.plan import Plan
    from planner.profile import Profile
    from planner.simulator import simulate

    d = json.loads(Path(path).read_text())
    profile = Profile.from_dict(d["profile"])
    rows = d["rows"]
    obs = [Observation(Plan.from_dict(r["plan_json"]), r["measured_ms"]) for r in rows]
    measured = [o.measured_ms for o in obs]
    train = [o for o, r in zip(obs, rows) if r["fit"]]
    held = [o for o, r in zip(obs, rows) if not r["fit"]]
    cal = calibrated(profile, fit(profile, train))
    print(f"\n{d['study']} (measurements from {path}); calibration fitted on the {len(train)} plans marked 'fit': "
          + ", ".join(f"{k} {v:.3g}" for k, v in cal.calibration.items()))
    print(f"{'plan':<38} {'set':<5} {'measured':>9} {'predicted':>9} {'err %':>7} {'calibr.':>9} {'err %':>7}")
    for r, o in zip(rows, obs):
        raw, c = simulate(profile, o.plan).step_ms, simulate(cal, o.plan).step_ms
        print(f"{r['plan']:<38} {'fit' if r['fit'] else 'held':<5} {o.measured_ms:>9.1f} {raw:>9.1f} "
              f"{100 * (raw / o.measured_ms - 1):>+7.1f} {c:>9.1f} {100 * (c / o.measured_ms - 1):>+7.1f}")
    hm = [o.measured_ms for o in held]
    print(f"held-back plans ({len(held)}): before calibration {summary(errors_pct(profile, held))}, Spearman "
          f"{spearman([simulate(profile, o.plan).step_ms for o in held], hm):.2f}; after "
          f"{summary(errors_pct(cal, held))}, Spearman {spearman([simulate(cal, o.plan).step_ms for o in held], hm):.2f}")
    loo = [simulate(calibrated(profile, fit(profile, obs[:i] + obs[i + 1:])), o.plan).step_ms
           for i, o in enumerate(obs)]
    print(f"leave-one-out (all {len(obs)} plans): {summary([100 * (p / m - 1) for p, m in zip(loo, measured)])}, "
          f"Spearman {spearman(loo, measured):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("studies", nargs="*", default=["studies/llama-cpu.toml", "studies/gpt2-cpu.toml"])
    parser.add_argument("--rounds", type=int, default=5)
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
