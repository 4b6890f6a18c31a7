"""Benchmark: another layout predicted from one-node profiles, checked on the emulated cluster.

    python -m bench.layout_sweep [bench/llama-link.toml] [--rates 4gbit,1gbit] [--layouts fsdp,hsdp] [--rounds 16]
                                 [--profiles 3] [--json OUT]
    python -m bench.layout_sweep --refit OUT.json      # report a saved run again, measuring nothing
    python -m bench.layout_sweep --from-work DIR       # predict a run's rows again from its profiles, measuring nothing

1. ``--profiles`` profiles of 4 ranks on one node (the study with ``nproc_per_node = 4``, no mesh), each in fresh
   processes (``prefetch-planner profile``), unless ``--profile`` gives one.
2. Per rate and layout, a target of 2 nodes x 2 ranks: FSDP over all 4 (``fsdp``) or HSDP ``[2, 2]`` (``hsdp``:
   the shard groups within a node, the replicas across the link); the intra-node link is the recorded one. From each
   profile, the what-if (``planner.simulation.what_if.Scenario``, as ``simulate --target``) predicts FSDP2's default
   and its band; from the first, the study's simulated search (``planner.study.simulated.simulated_stage``) on the
   retargeted profile ranks the plans: its first is the *predicted plan*.
3. On a fresh cluster at the rate (``bench/cluster.py``, 2 ranks per node, the layout's ``[launch] mesh``): the
   predicted plan against FSDP2's default in fresh processes, ``--rounds`` interleaved rounds, each pair's order
   drawn at random (``bench.verdicts --part remeasure``).

Reported per rate and layout: the default step predicted from each profile against its median measured there
(targets: within 10% for FSDP, 15% for HSDP), the predictions' spread over the profiles (each within 5% of their
mean), whether each band holds the measured median, and the predicted plan's ratio to the default, predicted and
measured with its interval. The machine's 2 cores run the 4 ranks in the profiles and in every measurement alike:
compute per rank is the same in both, and only the layout and the link differ.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import time
from pathlib import Path

import click

from bench.cluster import Cluster, rate_bits
from bench.what_if_checks import checked, largest_from_mean

MODULE = "bench.layout_sweep"
LAYOUTS = {"fsdp": None, "hsdp": (2, 2)}
WORLD, PER_NODE = 4, 2


def with_launch(study: str, work: Path, name: str, nproc_per_node: int, mesh: tuple[int, int] | None) -> str:
    """A copy of the study TOML with its ``[launch]`` ranks and mesh set; its path."""
    text = Path(study).read_text()
    text = re.sub(r"(?m)^nproc_per_node\s*=.*$", f"nproc_per_node = {nproc_per_node}", text)
    text = re.sub(r"(?m)^mesh\s*=.*$\n?", "", text)
    if mesh is not None:
        text = text.replace("[launch]\n", f"[launch]\nmesh = [{mesh[0]}, {mesh[1]}]\n", 1)
    path = work / f"{name}.toml"
    path.write_text(text)
    return str(path)


def record_one_node(study: str, work: Path, index: int = 1) -> Path:
    """The study's profile on 4 ranks of this machine (one node, no mesh), in fresh processes; its path."""
    import subprocess

    toml = with_launch(study, work, "one-node", WORLD, None)
    out = work / f"profile-{index}.json"
    subprocess.run([sys.executable, "-m", "jobs.cli", "profile", toml, "-o", str(out)], check=True)
    return out


def target_for(rate: str, mesh: tuple[int, int] | None):
    """2 nodes x 2 ranks at ``rate``, FSDP (``mesh`` ``None``) or HSDP; the intra-node link as recorded: the
    emulated cluster's preset (``cpu-emulated-1gbit``, with its stated spread) where there is one."""
    from planner.artifacts.target import Target, load_target, presets

    bits = rate_bits(rate)
    if bits is None:
        raise click.BadParameter(f"rate {rate!r}: the layouts are checked on a shaped link (4gbit, 1gbit)")
    if f"cpu-emulated-{rate}" in presets():
        return load_target(f"cpu-emulated-{rate}", world_size=WORLD, ranks_per_node=PER_NODE, mesh=mesh)
    return Target(world_size=WORLD, ranks_per_node=PER_NODE, backend="gloo", mesh=mesh,
                  link={"inter_node": {"bandwidth": f"{bits / 1e9:g}Gbit/s"},
                        "intra_node": {"bandwidth": "recorded"}})


def predict_default(profile_path: Path, rate: str, layout: str) -> dict:
    """FSDP2's default on the target, from one one-node profile: the predicted step and its band, ms."""
    from planner.artifacts.profile import Profile
    from planner.simulation.what_if import Scenario

    scenario = Scenario.of(Profile.load(profile_path), target_for(rate, LAYOUTS[layout]))
    band = scenario.band()
    return {"profile": profile_path.name, "default_ms": band.step_ms,
            "default_band": [band.low_ms, band.high_ms, band.dominant.name],
            "comm_scale": scenario.params.comm_scale, "distance": scenario.retargeted.extrapolation.describe()}


def predict(study: str, profile_path: Path, rate: str, layout: str, measured_plan: dict | None = None) -> dict:
    """FSDP2's default and the predicted plan on the target, from the one-node profile; ``measured_plan``: the plan
    a finished run measured, predicted again in place of a new search's."""
    import optuna

    from planner.artifacts.config import load_study_config
    from planner.artifacts.plan import Plan
    from planner.artifacts.profile import Profile
    from planner.simulation.what_if import Scenario
    from planner.study.simulated import complete_trials, simulated_stage
    from search_spaces import get_space

    config = load_study_config(study)
    scenario = Scenario.of(Profile.load(profile_path), target_for(rate, LAYOUTS[layout]))
    simulator = scenario.simulator()
    if measured_plan is not None:
        plan = Plan.from_dict(measured_plan)
    else:
        space = get_space(config.search.space)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study_run = simulated_stage(simulator, config, optuna.storages.InMemoryStorage(), space,
                                    show_progress_bar=False)
        best = min(complete_trials(study_run), key=lambda t: t.values[0])
        plan = space.build(best.params, scenario.simulated)
    default = simulator.run(Plan.default(scenario.simulated))
    predicted = simulator.run(plan)
    bands = {name: scenario.band(p) for name, p in (("default", None), ("plan", plan))}
    return {"plan": plan.to_dict(), "default_ms": default.step_ms, "plan_ms": predicted.step_ms,
            "ratio": predicted.step_ms / default.step_ms, "distance": scenario.retargeted.extrapolation.describe(),
            **{f"{name}_band": [b.low_ms, b.high_ms, b.dominant.name] for name, b in bands.items()}}


def measure(study: str, plan: dict, rate: str, layout: str, rounds: int, work: Path) -> dict:
    """The predicted plan against FSDP2's default on a fresh cluster at ``rate``: each one's step times, ms."""
    from planner.artifacts.plan import Plan

    toml = with_launch(study, work, "cluster", PER_NODE, LAYOUTS[layout])
    Plan.from_dict(plan).to_json(work / "predicted.json")
    out = work / "remeasure.json"
    with Cluster(rate) as cluster:
        launch = cluster.torchrun(["-m", "bench.verdicts", toml, "--part", "remeasure", "--plan",
                                   str(work / "predicted.json"), "--rounds", str(rounds), "--out", str(out)],
                                  nproc_per_node=PER_NODE, logs=work, rdzv_id="layout")
        codes = launch.wait(3600)
        if any(codes):
            sys.exit(f"the measurement failed on the cluster ({codes}):\n{launch.output()[-6000:]}")
    return json.loads(out.read_text())


def profiles_in(work: Path) -> list[Path]:
    """A run's one-node profiles, in the order they were recorded (``profile.json``: a run of one profile)."""
    found = sorted(work.glob("profile-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    return found or [work / "profile.json"]


def predicted_again(study: str, work: Path, rates: str, layouts: str) -> list[dict]:
    """Each row of a finished run predicted again from its own profiles (the plan it measured, not a new search's);
    its measurements as they were saved."""
    runs = []
    profiles = profiles_in(work)
    for rate in rates.split(","):
        for layout in layouts.split(","):
            folder = work / f"{rate}-{layout}"
            measured_plan = json.loads((folder / "predicted.json").read_text())
            predicted = predict(study, profiles[0], rate, layout, measured_plan)
            runs.append({"rate": rate, "layout": layout, "predicted": predicted, "seconds": 0.0,
                         "defaults": [predict_default(p, rate, layout) for p in profiles],
                         "measured": json.loads((folder / "remeasure.json").read_text())})
    return runs


def report(runs: list[dict]) -> None:
    """Print the table from the runs."""
    from planner.statistics.verdict import confirm

    click.echo("| link | layout | default: predicted | measured (median) | error | target | predicted plan: "
               "predicted ratio | measured ratio [95% CI] | verdict |")
    click.echo("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        m = r["measured"]
        measured = statistics.median(m["default"])
        error = r["predicted"]["default_ms"] / measured - 1
        limit = 0.10 if r["layout"] == "fsdp" else 0.15
        c = confirm(m["tuned"], m["default"], noise_pct=float("nan"))
        verdict = "faster" if c.ci95[1] < 1 else "slower" if c.ci95[0] > 1 else "no difference shown"
        click.echo(f"| {r['rate']} | {r['layout']} | {r['predicted']['default_ms']:.0f} ms | {measured:.0f} ms | "
                   f"{error:+.1%} | {'within' if abs(error) <= limit else 'outside'} {limit:.0%} | "
                   f"{r['predicted']['ratio']:.3f} | {c.ratio:.3f} [{c.ci95[0]:.3f}, {c.ci95[1]:.3f}] "
                   f"({len(m['tuned'])} rounds) | {verdict} |")
    for r in runs:
        click.echo(f"- {r['rate']} {r['layout']}: {r['predicted']['distance']}; {r['seconds']:.0f} s")
    if all("default_band" in r["predicted"] for r in runs):
        coverage(runs)
    stability(runs)


def coverage(runs: list[dict]) -> None:
    """Each predicted step's band (``planner.simulation.band``) against the measured median: inside or not."""
    click.echo("\n| link | layout | plan | predicted | band | largest part | measured (median) | inside |")
    click.echo("|---|---|---|---|---|---|---|---|")
    inside = 0
    for r in runs:
        for name, key in (("FSDP2 default", "default"), ("predicted plan", "plan")):
            low, high, dominant = r["predicted"][f"{key}_band"]
            measured = statistics.median(r["measured"]["default" if key == "default" else "tuned"])
            hit = low <= measured <= high
            inside += hit
            click.echo(f"| {r['rate']} | {r['layout']} | {name} | {r['predicted'][f'{key}_ms']:.0f} ms | "
                       f"[{low:.0f}, {high:.0f}] | {dominant} | {measured:.0f} ms | {'yes' if hit else '**no**'} |")
    click.echo(f"\n{inside} of {2 * len(runs)} measured medians inside their bands")


def stability(runs: list[dict]) -> None:
    """FSDP2's default predicted from each profile: its error, the spread over the profiles, the band's hold."""
    if not all(r.get("defaults") for r in runs):
        return
    count = len(runs[0]["defaults"])
    click.echo("\n| link | layout | measured (median) | " + " | ".join(f"profile {i + 1}: predicted, error, band"
                                                                         for i in range(count))
               + " | spread (largest from the mean) | comm_scale |")
    click.echo("|---|---|---|" + "---|" * count + "---|---|")
    within = inside = total = 0
    for r in runs:
        measured = statistics.median(r["measured"]["default"])
        limit = 0.10 if r["layout"] == "fsdp" else 0.15
        spread = largest_from_mean([d["default_ms"] for d in r["defaults"]])
        checks = [checked(d["default_ms"], d["default_band"][0], d["default_band"][1], measured, limit)
                  for d in r["defaults"]]
        within += sum(c.within for c in checks)
        inside += sum(c.inside for c in checks)
        total += len(checks)
        scales = ", ".join(f"{d['comm_scale']:.2f}" for d in r["defaults"])
        click.echo(f"| {r['rate']} | {r['layout']} | {measured:.0f} ms | " + " | ".join(c.cell for c in checks)
                   + f" | {spread:.1%}{'' if spread <= 0.05 else ' (**over 5%**)'} | {scales} |")
    click.echo(f"\n{within} of {total} predictions within their target; {inside} of {total} bands hold the "
               "measured median")


@click.command()
@click.argument("study", default="bench/llama-link.toml")
@click.option("--rates", default="4gbit,1gbit", show_default=True)
@click.option("--layouts", default="fsdp,hsdp", show_default=True)
@click.option("--rounds", default=16, show_default=True)
@click.option("--profiles", "profile_count", default=3, show_default=True,
              help="One-node profiles to record, each in fresh processes; every layout is predicted from each.")
@click.option("--profile", "profile_path", help="One one-node profile of 4 ranks (else --profiles are recorded).")
@click.option("--json", "json_out", help="Write every run's figures here.")
@click.option("--refit", help="Report a saved --json run again, measuring nothing.")
@click.option("--from-work", "from_work", help="Predict again (bands included) against the measurements a run left in "
                                               "its work folder (layout-sweep-*), measuring nothing.")
def main(study, rates, layouts, rounds, profile_count, profile_path, json_out, refit, from_work) -> None:
    """Predict each layout from one-node profiles, then measure it on the emulated cluster."""
    if refit:
        report(json.loads(Path(refit).read_text())["runs"])
        return
    if from_work:
        report(predicted_again(study, Path(from_work), rates, layouts))
        return
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="layout-sweep-"))
    click.echo(f"work folder: {work}")
    profiles = ([Path(profile_path)] if profile_path
                else [record_one_node(study, work, i + 1) for i in range(profile_count)])
    runs = []
    for rate in rates.split(","):
        for layout in layouts.split(","):
            t0 = time.monotonic()
            folder = work / f"{rate}-{layout}"
            folder.mkdir(parents=True, exist_ok=True)
            predicted = predict(study, profiles[0], rate, layout)
            defaults = [predict_default(p, rate, layout) for p in profiles]
            measured = measure(study, predicted["plan"], rate, layout, rounds, folder)
            runs.append({"rate": rate, "layout": layout, "predicted": predicted, "defaults": defaults,
                         "measured": measured, "seconds": time.monotonic() - t0})
            if json_out:
                Path(json_out).write_text(json.dumps({"profiles": [str(p) for p in profiles], "runs": runs},
                                                     indent=1))
    report(runs)


if __name__ == "__main__":
    main()
