"""Benchmark: the settings frameworks ship, side by side with the tuned plan, in fresh launches.

    python -m bench.peers studies/llama-cpu.toml [--plan PLAN_JSON] [--launches 3] [--rounds 14] [--json OUT]

The plans, built for the study's model from its profile (``NAME.profile.json``, which ``tune`` writes):
- FSDP2's default;
- NeMo-Automodel's prefetch depths (forward 1, backward 2: ``fsdp2_forward_prefetch_depth``,
  ``fsdp2_backward_prefetch_depth``);
- verl's forward prefetch depth 1 (``verl/utils/fsdp_utils.py``);
- torchtitan's ``reshard_after_forward`` policies "never" (every module keeps its parameters after forward) and
  "always" (every module reshards, the root too);
- the best plan of the uniform grid, by prediction (the hand-set knobs every FSDP2 user has);
- the study's plan (``--plan``, default ``NAME.plan.json``).
Each launch is a fresh ``torch.distributed.run`` of the study's ranks: one model, every plan warmed up, then
``--rounds`` rounds of one step per plan in a Williams design (every plan follows every other equally often), each
step after a barrier, its figure the max across ranks. Per plan, its total-time ratio to FSDP2's default and the
study's plan's ratio to it, each with its 95% interval over the launches (``confirm_launches``: the spread between
launches floored at the device's prior), and the simulator's prediction beside.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import click

from bench.ranks import run_studies

MODULE = "bench.peers"
WARMUP_STEPS = 2


def peer_plans(profile, study_plan=None) -> dict:
    """The plans of the comparison, by name, for ``profile``'s model (FSDP2's default first)."""
    import dataclasses

    from planner.artifacts.plan import ModulePlan, Plan
    from planner.simulation.parameters import simulator_for
    from search_spaces.uniform import UniformSpace

    default = Plan.default(profile)
    blocks = [f for f in profile.post_forward_order if f != ""]

    def depths(forward: int, backward: int) -> Plan:
        modules = dict(default.modules)
        for i, fqn in enumerate(blocks):
            modules[fqn] = dataclasses.replace(
                modules[fqn], forward_prefetch=tuple(blocks[i + 1:i + 1 + forward]),
                backward_prefetch=tuple(reversed(blocks[max(0, i - backward):i])))
        return dataclasses.replace(default, modules=modules)

    def reshard(value: bool) -> Plan:
        return dataclasses.replace(default, modules={f: ModulePlan(reshard_after_forward=value)
                                                     for f in default.modules})

    simulator = simulator_for(profile)
    space = UniformSpace()
    grid = [space.build(params, profile) for params in space.grid(profile)]
    best_uniform = min(grid, key=lambda p: simulator.run(p).step_ms)
    plans = {"FSDP2 default": default, "NeMo-Automodel (forward 1, backward 2)": depths(1, 2),
             "verl (forward 1)": depths(1, 0), "torchtitan reshard never": reshard(False),
             "torchtitan reshard always": reshard(True), "best uniform plan (predicted)": best_uniform}
    if study_plan is not None:
        plans["the study's plan"] = study_plan
    return plans


def rank_main(study: str, plans_path: str, rounds: int, out: str) -> None:
    """Every rank of one launch: the plans' rounds; rank 0 writes ``out``."""
    import torch.distributed as dist

    from planner.artifacts.config import load_study_config
    from planner.artifacts.plan import Plan
    from planner.statistics.race import balanced_orders
    from runtime.measuring.measure import measure_plans
    from runtime.ranks.rank import job_rank
    from runtime.recording.steps import WorkloadSteps
    from runtime.workload import build_study_workload

    config = load_study_config(study)
    with job_rank(config.launch) as rank:
        mesh = rank.mesh
        named = {name: Plan.from_dict(d) for name, d in json.loads(Path(plans_path).read_text()).items()}
        workload = build_study_workload(config.workload, mesh)
        plans = list(named.values())
        design = balanced_orders(len(plans))
        step_ms = measure_plans(WorkloadSteps(workload, plans), [design[r % len(design)] for r in range(rounds)],
                                WARMUP_STEPS)
        if dist.get_rank() == 0:
            Path(out).write_text(json.dumps(dict(zip(named, step_ms, strict=True))))
        del workload
        rank.ended = True


def report(config, plans: dict, launches: list[dict], profile) -> list[dict]:
    """Print the table; the rows as dicts."""
    from planner.simulation.parameters import simulator_for
    from planner.statistics.launches import ConfirmLaunch, prior_for
    from planner.statistics.verdict import confirm_launches

    prior = prior_for(profile.fingerprint.device_type).spread
    simulator = simulator_for(profile)
    default = next(iter(plans))
    study = "the study's plan" if "the study's plan" in plans else None
    rows = []
    print(f"\n{config.name}: {len(plans)} plans, {len(launches)} fresh launches of {len(launches[0][default])} rounds "
          f"(Williams design), spread floored at {prior.tau:.3f}")
    print(f"{'plan':<40} {'predicted':>9} {'ratio to default [95% CI]':>28} {'study plan / it [95% CI]':>28}")
    for name in plans:
        predicted = simulator.run(plans[name]).step_ms
        to_default = confirm_launches([ConfirmLaunch(x[name], x[default]) for x in launches], 0.0, prior,
                                      floor=prior)
        vs_study = None
        if study and name != study:
            vs_study = confirm_launches([ConfirmLaunch(x[study], x[name]) for x in launches], 0.0, prior,
                                        floor=prior)
        row = {"plan": name, "predicted_ms": predicted, "ratio": to_default.ratio, "ci95": list(to_default.ci95),
               "study_over_it": None if vs_study is None else vs_study.ratio,
               "study_over_it_ci95": None if vs_study is None else list(vs_study.ci95)}
        rows.append(row)
        theirs = "" if vs_study is None else (f"{vs_study.ratio:.3f} [{vs_study.ci95[0]:.3f}, "
                                               f"{vs_study.ci95[1]:.3f}]")
        print(f"{name:<40} {predicted:>8.0f}ms {to_default.ratio:>7.3f} [{to_default.ci95[0]:.3f}, "
              f"{to_default.ci95[1]:.3f}]{'':>6} {theirs:>28}")
    return rows


@click.command(help=__doc__)
@click.argument("study", type=click.Path(dir_okay=False))
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False), help="the tuned plan (default: NAME.plan.json)")
@click.option("--launches", default=3, show_default=True, help="fresh launches")
@click.option("--rounds", default=14, show_default=True, help="rounds per launch, one step of every plan each")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="write every launch and the rows here")
@click.option("--plans", "plans_path", hidden=True)
@click.option("--out", hidden=True)
def main(study: str, plan_path: str | None, launches: int, rounds: int, json_out: str | None,
         plans_path: str | None, out: str | None) -> None:
    if plans_path is not None:  # one rank of one launch
        run_studies(MODULE, [study], lambda _: [], lambda s: rank_main(s, plans_path, rounds, out))
        return
    from planner.artifacts.config import load_study_config
    from planner.artifacts.plan import Plan
    from planner.artifacts.profile import Profile
    from planner.errors import PlannerError

    config = load_study_config(study)
    profile_path = Path(config.default_output(".profile.json"))
    if not profile_path.exists():
        raise click.ClickException(f"no profile at {profile_path}: run `prefetch-planner tune {study}` first")
    profile = Profile.load(profile_path)
    plan_path = plan_path or config.default_output(".plan.json")
    try:
        study_plan = Plan.load(plan_path) if Path(plan_path).exists() else None
    except PlannerError as e:
        raise click.ClickException(str(e)) from None
    plans = peer_plans(profile, study_plan)
    tmp = Path(tempfile.mkdtemp(prefix="peers-"))
    (tmp / "plans.json").write_text(json.dumps({name: p.to_dict() for name, p in plans.items()}))
    measured = []
    for i in range(launches):
        path = tmp / f"launch{i}.json"
        forward = [study, "--plans", str(tmp / "plans.json"), "--rounds", str(rounds), "--out", str(path)]
        run_studies(MODULE, [study], lambda _, f=forward: f, lambda s: None)
        measured.append(json.loads(path.read_text()))
        print(f"launch {i}: done", flush=True)
    rows = report(config, plans, measured, profile)
    if json_out:
        Path(json_out).write_text(json.dumps({"study": study, "launches": measured, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
