"""Benchmark: do the tool's verdicts hold on the real ranks?

    python -m bench.verdicts studies/llama-cpu.toml [--aa-races 20] [--rounds 24] [--remeasures 3]
                             [--runs 4000,2000,1000]
                             [--skip-synthetic] [--skip-aa] [--skip-coverage]

(a) Synthetic launches, torch-free, through the project's own verdict:
    false "faster" with a spread learned low from other plans, the restart
    path's looks at the prior's spread and above it, a plan faster on most
    steps that stalls, the in-loop restart chain after a race, and the power
    at 10% and 7% gains. Each rate with its exact binomial 95% interval.
    Then power on a calibrated cluster: spreads of 0.5-4.5% between
    launches, gains of 2-8%, through the product's calibration and design.
(b) A/A on real ranks. Races in which the one candidate *is* FSDP2's default
    (the same plan under another index), each followed by its confirmation on
    fresh rounds in the same processes, as ``tune`` runs them under torchrun
    (``planner.statistics.schedule.Schedule``). Prints the false "faster" rate
    with its exact binomial interval (nominal: at most 2.5%).
(c) Coverage. ``prefetch-planner tune`` on the study (a fresh SQLite
    storage; the survivor confirmed in ``[measure] confirm_launches`` fresh
    launches), then ``--remeasures`` independent re-measurements, each in a
    separate process: one model instance per plan, ``--rounds`` interleaved
    rounds (each pair of rounds in both orders). Reports each ratio and their
    median beside the interval ``tune`` reported (one interval against a few
    re-measurements is not a coverage test; part (a)'s rates are).

Starts the study's ranks itself (they run ``python -m bench.verdicts --part
aa`` / ``--part remeasure``).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from planner.artifacts.tables import LaunchTable

MODULE = "bench.verdicts"


def aa_main(study: str, races: int, out: str) -> None:
    """Every rank: ``races`` A/A races and confirmations (the default against itself); rank 0 writes ``out``."""
    import torch.distributed as dist

    from planner.artifacts.config import load_study_config
    from planner.artifacts.plan import Plan
    from planner.statistics.schedule import Schedule
    from runtime.measuring.measure import measure_plans
    from runtime.ranks.rank import job_rank
    from runtime.recording.recorder import record_profile
    from runtime.recording.steps import WorkloadSteps
    from runtime.workload import build_study_workload

    config = load_study_config(study)
    with job_rank(config.launch) as rank:
        mesh = rank.mesh
        workload = build_study_workload(config.workload, mesh)
        profile = record_profile(workload, warmup_steps=1, steps=2, repeats=1)
        default = Plan.default(profile)
        results = []
        for race in range(races):
            schedule = Schedule(2, config.measure.race_settings(), config.measure.confirm_settings(launches=0))
            t0 = time.monotonic()
            measure_plans(WorkloadSteps(workload, [default, default]), schedule if dist.get_rank() == 0 else None,
                          config.measure.warmup_steps)
            if dist.get_rank() == 0:
                c = schedule.confirmation
                if c is None:  # the race dropped the candidate, FSDP2's default itself: a false drop (<= alpha)
                    results.append({"race": race, "verdict": "dropped", "race_rounds": len(schedule.race.rounds),
                                    "noise_pct": schedule.race.noise_pct(), "seconds": time.monotonic() - t0})
                    print(f"A/A race {race + 1}/{races}: the candidate was dropped in the race", flush=True)
                    continue
                row = {"race": race, "verdict": str(c.verdict), "ratio": c.ratio, "ci95": list(c.ci95),
                       "rounds": c.rounds, "race_rounds": len(schedule.race.rounds), "noise_pct": c.noise_pct,
                       "seconds": time.monotonic() - t0}
                results.append(row)
                print(f"A/A race {race + 1}/{races}: {c.verdict}, ratio {c.ratio:.3f} "
                      f"[{c.ci95[0]:.3f}, {c.ci95[1]:.3f}] over {c.rounds} rounds (race {row['race_rounds']} rounds), "
                      f"noise {c.noise_pct:.1f}%, {row['seconds']:.0f} s", flush=True)
        if dist.get_rank() == 0:
            Path(out).write_text(json.dumps(results, indent=1))
        del workload
        rank.ended = True


def remeasure_main(study: str, plan_path: str, rounds: int, out: str) -> None:
    """Every rank: two model instances (FSDP2's default, the plan), ``rounds`` interleaved rounds; rank 0 reports."""
    import torch.distributed as dist

    from jobs.confirm import rounds_on_own_models
    from planner.artifacts.config import load_study_config
    from planner.artifacts.plan import Plan
    from planner.statistics.schedule import confirmation_orders
    from runtime.apply import load_plan
    from runtime.ranks.collectives import broadcast_from_rank0
    from runtime.ranks.rank import job_rank
    from runtime.workload import build_study_workload

    config = load_study_config(study)
    with job_rank(config.launch) as rank:
        mesh = rank.mesh
        plan = load_plan(plan_path)
        models = [build_study_workload(config.workload, mesh), build_study_workload(config.workload, mesh)]
        orders = broadcast_from_rank0(confirmation_orders((0, 1), rounds) if dist.get_rank() == 0 else None, None)
        # the second model keeps every module as wrapped: FSDP2's default
        tuned, default = rounds_on_own_models(models, [plan, Plan(plan.fingerprint, {})], orders, 2, None)
        if dist.get_rank() == 0:
            Path(out).write_text(json.dumps({"tuned": tuned, "default": default}))
        del models
        rank.ended = True


def _launch(args: list[str], launch: LaunchTable) -> None:
    """Start ``python -m bench.verdicts ARGS`` on the study's ranks, under its ``[launch]`` (ranks, allocator)."""
    from runtime.ranks.launch import launch_ranks

    code = launch_ranks(args, launch, module=MODULE)
    if code:
        sys.exit(code)


def coverage(study: str, rounds: int, remeasures: int, work: Path) -> dict:
    """Tune into a fresh storage, then re-measure its confirmed plan ``remeasures`` times independently."""
    from planner.artifacts.config import load_study_config
    from planner.artifacts.plan import Plan
    from planner.statistics.verdict import confirm
    from planner.study import best_plan

    config = load_study_config(study)
    storage, plan_out = f"sqlite:///{work}/coverage.db", str(work / "plan.json")
    t0 = time.monotonic()
    tune = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.cli",
            "tune",
            study,
            "--storage",
            storage,
            "--plan-out",
            plan_out,
            "--profile-out",
            str(work / "profile.json"),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
    )
    tune_s = time.monotonic() - t0
    print(tune.stdout)
    if tune.returncode:
        print(tune.stderr, file=sys.stderr)
        sys.exit(tune.returncode)
    written = Plan.load(plan_out)
    best = best_plan(storage, config.name)
    reported = best.plan if not best.keeps_baseline else best.survivor  # the confirmed candidate
    if reported is None:
        print("\ncoverage: the race dropped every candidate; nothing confirmed to re-measure")
        return {"tune_s": tune_s, "verdict": None}
    pv = reported.provenance
    reported.to_json(work / "reported.json")  # the confirmed candidate, written or not
    independent = []
    for k in range(remeasures):
        measured = work / f"remeasure{k}.json"
        _launch(["--part", "remeasure", study, "--plan", str(work / "reported.json"), "--rounds", str(rounds),
                 "--out", str(measured)], config.launch)
        times = json.loads(measured.read_text())
        c = confirm(times["tuned"], times["default"], noise_pct=float("nan"))
        independent.append({"ratio": c.ratio, "ci95": list(c.ci95), "rounds": rounds})
        print(f"independent re-measurement {k + 1}/{remeasures} ({rounds} interleaved rounds, one model instance "
              f"per plan, a fresh process): ratio {c.ratio:.3f} [{c.ci95[0]:.3f}, {c.ci95[1]:.3f}]", flush=True)
    middle = statistics.median(x["ratio"] for x in independent)
    print(f"\ncoverage: tune took {tune_s:.0f} s; it reported trial {pv.trial}: {pv.verdict}, ratio "
          f"{pv.measured_ratio:.3f} [{pv.ratio_ci95[0]:.3f}, {pv.ratio_ci95[1]:.3f}] over {pv.rounds} rounds in "
          f"{pv.launches or 1} launch(es); written: "
          f"{'that plan' if written.behaviour_key() == reported.behaviour_key() else 'FSDP2 default'}")
    ratios = ", ".join(f"{x['ratio']:.3f}" for x in independent)
    print(f"independent re-measurements: median ratio {middle:.3f} of {remeasures} ({ratios}); one interval is not a "
          "coverage test (the synthetic part's rates are)")
    return {"tune_s": tune_s, "trial": pv.trial, "verdict": pv.verdict, "ratio": pv.measured_ratio,
            "ci95": list(pv.ratio_ci95), "rounds": pv.rounds, "launches": pv.launches, "independent": independent,
            "independent_median": middle}


def rate_text(events: int, runs: int) -> str:
    """``3/40 = 7.5% [1.6%, 20.4%]``: the rate with its exact (Clopper-Pearson) binomial 95% interval."""
    from scipy.stats import binomtest

    ci = binomtest(events, runs).proportion_ci(method="exact")
    return f"{events}/{runs} = {100 * events / runs:.1f}% [{100 * ci.low:.1f}%, {100 * ci.high:.1f}%]"


def aa(study: str, races: int, work: Path, launch: LaunchTable) -> list[dict]:
    """The A/A races on fresh ranks; prints the false 'faster' rate with its interval; the races' rows."""
    _launch(["--part", "aa", study, "--aa-races", str(races), "--out", str(work / "aa.json")], launch)
    rows = json.loads((work / "aa.json").read_text())
    false = sum(r["verdict"] == "faster" for r in rows)
    dropped = sum(r["verdict"] == "dropped" for r in rows)
    ratios = ", ".join(f"{r['ratio']:.3f}" for r in rows if "ratio" in r)
    print(f"\nA/A on real ranks: false 'faster' {rate_text(false, len(rows))} (nominal <= 2.5%); the candidate "
          f"dropped in the race {rate_text(dropped, len(rows))} (nominal <= alpha); ratios {ratios}; median noise "
          f"{statistics.median(r['noise_pct'] for r in rows):.1f}%")
    return rows


def synthetic_sweep(runs: int = 4000) -> list[dict]:
    """The verdict's error rates and power on synthetic launches, through the project's own code
    (``planner.testing.chains``: ``LaunchModel``, ``restart_path``, ``restart_chain``); each rate with its exact
    interval. The cases are the ones ``tests/planner/statistics/test_verdict.py`` and
    ``tests/planner/study/test_restart_chain.py`` hold to their bounds, with more draws, and the one they cannot
    hold: a plan whose spread exceeds the floor with nothing in the study to show it (tau 0.06)."""
    import numpy as np

    from planner.statistics.launches import DEFAULT_SPREAD, Spread, launch_estimate
    from planner.statistics.verdict import Verdict, confirm_launches
    from planner.testing.chains import LaunchModel, as_launches, restart_chain, restart_path

    def learned(plans: int) -> Spread:
        drawn = LaunchModel(tau=0.01).draw(plans, 2, seed=plans)
        return DEFAULT_SPREAD.updated([[launch_estimate(x.plan_ms, x.default_ms) for x in as_launches(c)]
                                       for c in drawn])

    def faster(model: LaunchModel, launches: int, seed: int, spread: Spread = DEFAULT_SPREAD) -> int:
        return sum(confirm_launches(as_launches(c), 0.0, spread).verdict == Verdict.FASTER
                   for c in model.draw(runs, launches, seed))

    out = []

    def report(label: str, events: int, total: int = runs) -> None:
        print(f"  {label}: {rate_text(events, total)}", flush=True)
        out.append({"case": label, "events": events, "runs": total})

    print(f"synthetic launches through planner.statistics.verdict ({runs} each; 24 rounds a launch, 4% step noise "
          "per plan, unless said)")
    for plans in (5, 20, 60):
        spread = learned(plans)
        for n in (1, 2):
            report(f"study spread learned at {spread.tau:.3f} from {plans} agreeing plans, the plan's own 0.04, "
                   f"{n} launch(es): false 'faster' (<= 2.5%)", faster(LaunchModel(tau=0.04), n, plans + n, spread))
    for tau in (DEFAULT_SPREAD.tau, 0.06):
        for name, spread in (("prior", DEFAULT_SPREAD), ("learned df 200", Spread(tau, 200.0))):
            report(f"restart path (looks at 1, 2, 3 launches), true tau {tau}, {name}: ever 'faster' "
                   f"({'<= 2.5%' if tau <= DEFAULT_SPREAD.tau else 'above the floor: reported, not bounded'})",
                   restart_path(LaunchModel(tau=tau), spread, runs, seed=int(1000 * tau) + int(spread.df)))
    for rounds in (8, 12, 24):
        stall = LaunchModel(gain=0.02, tau=0.02, noise=0.01, stall_p=0.1, rounds=rounds)
        report(f"2% faster, 1.5x stalls on 10% of steps (total {stall.total_ratio:.3f}), {rounds} rounds, learned "
               "spread 0.01: ever 'faster' over 1-3 launches (<= 2.5%)",
               restart_path(stall, Spread(0.01, 200.0), runs, seed=rounds))
    for candidates in (3, 5):
        rng = np.random.default_rng(candidates)
        chains = [restart_chain(rng, candidates) for _ in range(runs // 2)]
        offsets = [o for _, o in chains if o is not None]
        report(f"in-loop restart chain, {candidates} candidates with nothing to gain, tau 0.04 per plan and process "
               f"(survivor's offset in its race's process {100 * float(np.mean(offsets)):+.1f}%): ever 'faster' "
               "(<= 2.5%)", sum(Verdict.FASTER in v for v, _ in chains), len(chains))
    for gain, n in ((0.10, 2), (0.07, 3)):
        report(f"{100 * gain:.0f}% gain, tau 0.02, restart path to {n} launches: 'faster' (power, >= 80%)",
               restart_path(LaunchModel(gain=gain, tau=0.02), DEFAULT_SPREAD, runs, seed=n, launches=n))
    return out


def calibrated_power(runs: int = 2000) -> list[dict]:
    """Power and error on a calibrated cluster, through the product's calibration, design and verdict
    (``planner.testing.chains.calibrated_chain``: 12 fresh calibration launches over FSDP2's default against a copy of
    itself and two unselected plans; 12 rounds a launch, 1% step noise per plan): for true spreads between
    launches of 0.5, 1, 2 and 4.5% and true gains of 0 (A/A), 2, 3, 5 and 8%, the in-loop restart chain (a look
    per fresh launch up to the design's horizon) and ``tune`` (the design's launches, one look); then a plan whose
    own spread is twice the calibrated one."""
    from planner.testing.chains import LaunchModel, calibrated_chain

    out = []
    print(f"\npower on a calibrated cluster ({runs} chains each; 'ever faster' within the chain, exact 95% "
          "intervals; floor = the calibration's mean upper bound, horizon = the chain's mean fresh launches)")
    for tau in (0.005, 0.01, 0.02, 0.045):
        for launches, name in ((0, "in-loop chain"), (None, "tune")):
            row = {"tau": tau, "chain": name}
            cells = []
            for gain in (0.0, 0.02, 0.03, 0.05, 0.08):
                ever, floor, horizon = calibrated_chain(LaunchModel(gain=gain, tau=tau, noise=0.01, rounds=12), runs,
                                                        seed=int(1e4 * tau), tune_launches=launches)
                row[f"gain {gain:.2f}"] = ever / runs
                row["floor"], row["horizon"] = floor, horizon
                cells.append(f"{100 * gain:.0f}%: {100 * ever / runs:5.1f}%")
            print(f"  tau {tau:.3f}, {name:<13} floor {row['floor']:.4f}, horizon {row['horizon']:.1f}: "
                  + "; ".join(cells), flush=True)
            out.append(row)
    for tau in (0.005, 0.01, 0.02):
        ever, _, _ = calibrated_chain(LaunchModel(tau=2 * tau, noise=0.01, rounds=12), runs, seed=7,
                                      tau_calibration=tau)
        print(f"  a plan whose own spread is twice the calibrated {tau:.3f}: ever 'faster' with nothing to gain "
              f"{rate_text(ever, runs)} (not bounded: the floor assumes the calibrated spread)", flush=True)
        out.append({"tau": tau, "own": 2 * tau, "aa": ever / runs})
    return out


def first_run_rates(runs: int = 1000) -> list[dict]:
    """The in-loop tuner's first run on synthetic steps through the product (``planner.testing.chains.first_run``: the
    race and confirmation under the in-loop defaults, the in-process decision, the watch): how often the survivor
    runs for the rest of the process, by case."""
    import numpy as np

    from planner.testing.chains import first_run

    out = []
    print(f"\nthe first run, applied in its own process and watched ({runs} synthetic first runs each; 1% step noise, "
          "a drifting machine)")
    cases = [
        ("3 candidates, nothing to gain: applied (<= 5%)", [1.0] * 4, 0.0, None, 0, lambda r: r.applied),
        ("5 candidates, nothing to gain: applied (<= 5%)", [1.0] * 6, 0.0, None, 0, lambda r: r.applied),
        ("3 candidates, offsets tau 0.04: applied while slower in its own process (<= 2.5%)", [1.0] * 4, 0.04, None,
         0, lambda r: r.applied and r.offset > 0),
        ("5 candidates, offsets tau 0.04: applied while slower in its own process (<= 2.5%)", [1.0] * 6, 0.04, None,
         0, lambda r: r.applied and r.offset > 0),
        ("the stalling plan (2.9% slower in total): still applied after 500 watched steps (<= 5%)", [1.0, 0.98], 0.0,
         [0.0, 0.1], 500, lambda r: r.applied_at_end),
        ("a true 10% gain: applied in the first run and kept over 500 watched steps (>= 90%)", [1.0, 0.9, 1.0], 0.0,
         None, 500, lambda r: r.applied_at_end and r.survivor == 1),
    ]
    for k, (label, effects, tau, stalls, watched, counts) in enumerate(cases):
        rng = np.random.default_rng(100 + k)
        events = sum(bool(counts(first_run(rng, effects, tau, stall_p=stalls, watch_steps=watched)))
                     for _ in range(runs))
        print(f"  {label}: {rate_text(events, runs)}", flush=True)
        out.append({"case": label, "events": events, "runs": runs})
    return out


@click.command(help=__doc__)
@click.argument("study", default="studies/llama-cpu.toml", type=click.Path(dir_okay=False))
@click.option("--aa-races", default=20, show_default=True, help="A/A races")
@click.option("--rounds", default=24, show_default=True, help="rounds of each independent re-measurement")
@click.option("--remeasures", default=3, show_default=True, help="independent re-measurements, one process each")
@click.option("--skip-synthetic", is_flag=True)
@click.option("--runs", default="4000,2000,1000", show_default=True,
              help="draws of (a): synthetic launches per case of the sweep, chains per cell of the calibrated "
                   "cluster's power table, synthetic first runs per case (0 skips a part)")
@click.option("--skip-aa", is_flag=True)
@click.option("--skip-coverage", is_flag=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="write the figures here")
@click.option("--part", type=click.Choice(["aa", "remeasure"]), hidden=True)
@click.option("--plan", "plan_path", hidden=True)
@click.option("--out", hidden=True)
def main(study: str, aa_races: int, rounds: int, remeasures: int, skip_synthetic: bool, runs: str, skip_aa: bool,
         skip_coverage: bool, json_out: str | None, part: str | None, plan_path: str | None, out: str | None) -> None:
    from planner.artifacts.config import load_study_config
    from planner.errors import PlannerError
    from runtime.ranks.launch import in_torchrun

    try:
        if in_torchrun():
            if part == "aa":
                aa_main(study, aa_races, out)
            else:
                remeasure_main(study, plan_path, rounds, out)
            return
        config = load_study_config(study)
        try:
            sweep_runs, calibrated_runs, first_runs = (int(n) for n in runs.split(","))
        except ValueError:
            raise PlannerError(f"--runs takes three counts, SWEEP,CALIBRATED,FIRST (e.g. 4000,2000,1000), found "
                               f"{runs!r}") from None
        figures: dict = {}
        with tempfile.TemporaryDirectory() as d:
            work = Path(d)
            if not skip_synthetic and sweep_runs:
                figures["synthetic"] = synthetic_sweep(sweep_runs)
            if not skip_synthetic and calibrated_runs:
                figures["calibrated"] = calibrated_power(calibrated_runs)
            if not skip_synthetic and first_runs:
                figures["first_run"] = first_run_rates(first_runs)
            if not skip_aa:
                figures["aa"] = aa(study, aa_races, work, config.launch)
            if not skip_coverage:
                figures["coverage"] = coverage(study, rounds, remeasures, work)
        if json_out:
            Path(json_out).write_text(json.dumps(figures, indent=1, default=lambda x: None if x != x else x))
    except PlannerError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
