"""Benchmark: under a memory budget, does a per-module (``assign``) plan beat the best uniform plan on the ranks?

    python bench/memory_budget.py [studies/llama-cpu.toml studies/gpt2-cpu.toml] [--json out.json]
    python bench/memory_budget.py --refit run.json ...   # saved runs, today's simulator, no ranks
    python bench/memory_budget.py --blocks-only ...      # step 6 alone, on fresh ranks

One run per study, on its ranks, one model instance, a fresh process:

1. Record a profile (its ``measured_peak_bytes`` is FSDP2's default's peak).
2. The unconstrained best plan: a simulated ``assign`` study without a budget
   (``--sim-trials``), its best predicted plan; its peak is measured. The
   budget is the default's measured peak plus ``--share`` (3/4) of the
   unconstrained extra.
3. Candidates predicted within the budget: the ``assign`` study run again
   with the budget (Optuna constraints), its candidates
   (``planner.study.select_candidates``) that are not uniform plans; and the
   two best ``uniform`` grid plans (one global forward/backward depth, async
   unshard, reshard after forward). Their peaks are measured; a plan over the
   budget leaves.
4. Selection: ``--select-rounds`` interleaved rounds of the candidates and the
   default (Williams orders); the best measured ``assign`` plan and the best
   measured ``uniform`` plan go on.
5. Confirmation on fresh rounds (the selection's rounds are never reported):
   assign, uniform and the default, ``--rounds`` rounds, the order rotated
   (Williams design). Paired per-round ratios, median, 95% bootstrap interval
   and verdict (``planner.statistics.verdict.confirm``): assign/uniform, assign/default,
   uniform/default.
6. Keeping blocks unsharded: uniform forward prefetch 1 with async unshard,
   and the same keeping the last 1, 3 and all blocks unsharded after forward
   (``search_spaces.assign.keep_unsharded``), ``--block-rounds`` fresh rounds:
   the measured gain (ratio to the base, with its interval) against the
   predicted gain.

The simulator runs with the in-step parameters, as ``tune`` does
(``planner.simulation.in_step``). Targets (the memory-aware plans issue): assign/uniform
<= 0.95 with verdict "faster"; every plan's measured peak within the budget;
the predicted gain of keeping blocks within 3 points of the measured gain.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MIB = 2**20
SHARE = 0.75  # of the unconstrained best plan's extra peak above the default's


def _sim_study(profile, study: str, sim_trials: int, budget_bytes: int | None, params):
    """An in-memory simulated ``assign`` study (with Optuna constraints under a budget)."""
    import optuna

    from planner.artifacts.config import load_study_config
    from planner.study import simulated_stage
    from search_spaces import get_space

    config = load_study_config(study, space="assign", sim_trials=sim_trials)
    return simulated_stage(profile, config, optuna.storages.InMemoryStorage(), get_space("assign"), params,
                           show_progress_bar=False, budget_bytes=budget_bytes)


def unconstrained_best(profile, study: str, sim_trials: int, params):
    """The best predicted ``assign`` plan with no budget."""
    from planner.study import distinct_plans
    from search_spaces import get_space

    return distinct_plans(_sim_study(profile, study, sim_trials, None, params), profile, get_space("assign"))[0][1]


def candidates(profile, study: str, sim_trials: int, budget_bytes: int, params) -> dict:
    """Named candidates predicted within the budget: up to 3 per-module ``assign`` plans, the 2 best ``uniform`` plans."""
    import optuna

    from planner.simulation.parameters import simulate
    from planner.study import select_candidates
    from search_spaces import get_space, uniform

    sim = _sim_study(profile, study, sim_trials, budget_bytes, params)
    grid = [(g, get_space("uniform").suggest(optuna.trial.FixedTrial(g), profile)) for g in get_space("uniform").grid(profile)]
    uniform_keys = {plan.behaviour_key() for _, plan in grid}
    per_module = [c for c in select_candidates(sim, profile, get_space("assign"), 6, budget_bytes=budget_bytes)
                  if c.plan.behaviour_key() not in uniform_keys][:3]
    fitting = []
    for g, plan in grid[1:]:  # FSDP2's default first: not a candidate
        r = simulate(profile, plan, params)
        if r.peak_bytes <= budget_bytes and not plan.is_default_for(profile):
            fitting.append((r.step_ms, g, plan))
    fitting.sort(key=lambda x: x[0])
    out = {f"assign #{i + 1}": c.plan for i, c in enumerate(per_module)}
    for i, (_, g, plan) in enumerate(fitting[:2]):
        out[f"uniform #{i + 1} (fwd {g['forward_depth']}, bwd {g['backward_depth']}"
            f"{', async' if g['unshard_async_op'] else ''}{'' if g['reshard_after_forward'] else ', kept'})"] = plan
    return out


def rank_main(study: str, args) -> None:
    import optuna
    import torch.distributed as dist

    from planner.artifacts.config import load_study_config
    from planner.simulation.in_step import in_step_params
    from planner.artifacts.plan import Plan
    from planner.statistics.race import balanced_orders
    from runtime.measure import StepCounter, run_block
    from runtime.peak_memory import PEAK_STEPS, peak_of_steps, warm_up_measuring_peaks
    from runtime.protocol import broadcast_from_rank0, gather
    from runtime.rank import init_rank, shutdown_rank
    from runtime.recorder import record_profile
    from runtime.workload import build_study_workload
    from search_spaces import get_space, uniform
    from search_spaces.assign import keep_unsharded

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    config = load_study_config(study)
    mesh = init_rank(config.launch.backend)
    group = dist.group.WORLD
    rank0 = dist.get_rank() == 0
    workload = build_study_workload(config.workload, mesh)
    profile = record_profile(workload, warmup_steps=1, steps=config.measure.steps,
                             repeats=config.measure.profile_repeats)
    params = in_step_params(profile) if profile.in_step is not None else None
    steps = StepCounter()
    run: dict = {"study": config.name, "profile": profile.to_dict(), "share": args.share}

    def shared(make):  # rank 0 decides, every rank gets it
        return {n: Plan.from_dict(d) for n, d in broadcast_from_rank0(
            {n: p.to_dict() for n, p in make().items()} if rank0 else None, group).items()}

    def peaks(plans: dict) -> dict:
        local = warm_up_measuring_peaks(workload, list(plans.values()), PEAK_STEPS + 1, steps)
        reports = gather(local, group)
        return {n: peak_of_steps([rep[i] for rep in reports]) for i, n in enumerate(plans)}

    def interleaved(plans: dict, rounds: int) -> dict:
        names = list(plans)
        orders = balanced_orders(len(names))
        block = [orders[r % len(orders)] for r in range(rounds)]
        local = run_block(workload, list(plans.values()), block, steps)
        reports = gather(local, group)
        out: dict = {n: [] for n in names}
        for r, order in enumerate(block):
            for pos, i in enumerate(order):
                out[names[i]].append(max(rep[r][pos] for rep in reports))
        return out

    if not args.blocks_only:
        budget_stages(run, profile, study, args, shared, peaks, interleaved, params)
    if not args.skip_blocks:
        base = uniform.build(profile, 1, 1, True)
        blocks = len(profile.modules) - 1
        kept = {"prefetch 1 async": base}
        for k in sorted({1, min(3, blocks), blocks}):
            kept[f"+ last {k} kept unsharded"] = keep_unsharded(base, profile, k)
        run["blocks"] = {n: p.to_dict() for n, p in kept.items()}
        run["blocks_peaks"] = peaks(kept)
        run["blocks_times"] = interleaved(kept, args.block_rounds)
    if rank0:
        report(run)
        if args.json:
            Path(args.json).write_text(json.dumps(run, indent=1))
    del workload
    shutdown_rank()


def budget_stages(run: dict, profile, study: str, args, shared, peaks, interleaved, params) -> None:
    """Steps 2-5 (every rank): the budget, the candidates, the selection and the confirmation, into ``run``."""
    import torch.distributed as dist

    from planner.artifacts.plan import Plan

    rank0 = dist.get_rank() == 0
    best = shared(lambda: {"unconstrained best": unconstrained_best(profile, study, args.sim_trials, params)})
    default_peak = profile.measured_peak_bytes
    best_peak = peaks(best)["unconstrained best"]
    budget = int(default_peak + args.share * max(0, best_peak - default_peak))
    run.update(budget_bytes=budget, default_peak_bytes=default_peak, unconstrained=best["unconstrained best"].to_dict(),
               unconstrained_peak_bytes=best_peak)
    if rank0:
        print(f"\n== {run['study']}: FSDP2 default peak {default_peak / MIB:.1f} MiB, unconstrained best "
              f"{best_peak / MIB:.1f} MiB; budget {budget / MIB:.1f} MiB ({args.share:.0%} of the extra)", flush=True)
    cands = shared(lambda: candidates(profile, study, args.sim_trials, budget, params))
    cand_peaks = peaks(cands)
    fit = {n: p for n, p in cands.items() if cand_peaks[n] <= budget}
    default = {"FSDP2 default": Plan.default(profile)}
    selection = interleaved({**default, **fit}, args.select_rounds)
    pick = {}
    for kind in ("assign", "uniform"):
        mine = [n for n in fit if n.startswith(kind)]
        if mine:
            pick[kind] = min(mine, key=lambda n: sorted(selection[n])[len(selection[n]) // 2])
    run.update(candidates={n: {"plan": p.to_dict(), "measured_peak_bytes": cand_peaks[n]} for n, p in cands.items()},
               selection=selection, picked=pick)
    finalists = {**{pick[k]: fit[pick[k]] for k in pick}, **default}
    run["confirmation"] = interleaved(finalists, args.rounds)


def report(run: dict) -> dict:
    """Print one run's figures with today's simulator; returns the summary."""
    from planner.simulation.in_step import in_step_params
    from planner.artifacts.plan import Plan
    from planner.artifacts.profile import Profile
    from planner.simulation.parameters import simulate

    profile = Profile.from_dict(run["profile"])
    params = in_step_params(profile) if profile.in_step is not None else None
    summary: dict = {"study": run["study"]}

    def sim(d: dict):
        return simulate(profile, Plan.from_dict(d), params)

    if "budget_bytes" in run:
        _report_budget(run, sim, summary)
    else:
        print(f"\n== {run['study']}")
    if "blocks_times" in run:
        _report_blocks(run, sim, summary)
    return summary


def _report_budget(run: dict, sim, summary: dict) -> None:
    from planner.statistics.verdict import confirm, step_noise_pct

    budget = run["budget_bytes"]
    summary["budget_mib"] = budget / MIB
    print(f"\n== {run['study']}: budget {budget / MIB:.1f} MiB per rank = FSDP2 default's measured "
          f"{run['default_peak_bytes'] / MIB:.1f} + {run['share']:.0%} of the unconstrained best plan's extra "
          f"(measured {run['unconstrained_peak_bytes'] / MIB:.1f}, predicted {sim(run['unconstrained']).peak_bytes / MIB:.1f})")
    print(f"{'candidate':<44} {'pred ms':>8} {'sel ms':>8} {'pred MiB':>9} {'meas MiB':>9}  fits")
    for n, c in run["candidates"].items():
        r, sel = sim(c["plan"]), run["selection"].get(n)
        med = f"{sorted(sel)[len(sel) // 2]:8.0f}" if sel else f"{'-':>8}"
        print(f"{n:<44} {r.step_ms:>8.0f} {med} {r.peak_bytes / MIB:>9.1f} {c['measured_peak_bytes'] / MIB:>9.1f}  "
              f"{'yes' if c['measured_peak_bytes'] <= budget else 'NO'}")
    pick, times = run["picked"], run["confirmation"]
    print(f"selected on {len(run['selection']['FSDP2 default'])} rounds: " + ", ".join(f"{k}: {v}" for k, v in pick.items()))
    noise = step_noise_pct(list(times.values()))
    pairs = [("assign", "uniform"), ("assign", "default"), ("uniform", "default")]
    names = {**pick, "default": "FSDP2 default"}
    print(f"confirmation on {len(times['FSDP2 default'])} fresh rounds (order rotated), step noise {noise:.1f}%:")
    for a, b in pairs:
        if a in names and b in names:
            c = confirm(times[names[a]], times[names[b]], noise, seed=1)
            summary[f"{a}/{b}"] = {"ratio": c.ratio, "ci95": list(c.ci95), "verdict": str(c.verdict)}
            print(f"  {a}/{b}: ratio {c.ratio:.3f}, 95% CI [{c.ci95[0]:.3f}, {c.ci95[1]:.3f}], {c.verdict}")


def _report_blocks(run: dict, sim, summary: dict) -> None:
    from planner.statistics.verdict import confirm, step_noise_pct

    bt, plans = run["blocks_times"], run["blocks"]
    noise = step_noise_pct(list(bt.values()))
    base = "prefetch 1 async"
    b_sim = sim(plans[base])
    print(f"keeping blocks unsharded, against uniform prefetch 1 async ({len(bt[base])} fresh rounds): "
          "gain measured [95% CI] / predicted; peak measured / predicted MiB")
    summary["blocks"] = {}
    for n in plans:
        r = sim(plans[n])
        m = run["blocks_peaks"][n]
        if n == base:
            print(f"  {n:<28} {'':>31} {m / MIB:>8.1f} / {r.peak_bytes / MIB:.1f}")
            continue
        c = confirm(bt[n], bt[base], noise, seed=1)
        pred = r.step_ms / b_sim.step_ms
        summary["blocks"][n] = {"measured": c.ratio, "ci95": list(c.ci95), "predicted": pred,
                                "points_apart": 100 * abs(pred - c.ratio)}
        print(f"  {n:<28} {c.ratio:.3f} [{c.ci95[0]:.3f}, {c.ci95[1]:.3f}] / {pred:.3f} "
              f"({100 * (pred - c.ratio):+.1f} pts) {m / MIB:>8.1f} / {r.peak_bytes / MIB:.1f}")


def main() -> None:
    from _ranks import add_saved_run_arguments, refitted, run_studies

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("studies", nargs="*", default=["studies/llama-cpu.toml", "studies/gpt2-cpu.toml"])
    parser.add_argument("--sim-trials", type=int, default=600)
    parser.add_argument("--share", type=float, default=SHARE, help="of the unconstrained extra peak the budget allows")
    parser.add_argument("--select-rounds", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=24, help="fresh rounds of the confirmation")
    parser.add_argument("--block-rounds", type=int, default=16, help="fresh rounds of the keep-blocks comparison")
    parser.add_argument("--skip-blocks", action="store_true")
    parser.add_argument("--blocks-only", action="store_true", help="step 6 alone: the gains of keeping blocks")
    add_saved_run_arguments(parser)
    args = parser.parse_args()
    if refitted(args, report):
        return

    forwarded = ["--sim-trials", str(args.sim_trials), "--share", str(args.share), "--select-rounds",
                 str(args.select_rounds), "--rounds", str(args.rounds), "--block-rounds", str(args.block_rounds)]
    forwarded += (["--skip-blocks"] if args.skip_blocks else []) + (["--blocks-only"] if args.blocks_only else [])
    forwarded += ["--json", args.json] if args.json else []
    run_studies(__file__, args.studies, lambda study: [study] + forwarded, lambda: rank_main(args.studies[0], args))


if __name__ == "__main__":
    main()
