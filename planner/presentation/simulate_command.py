"""``prefetch-planner simulate`` and ``presets``: a plan's predicted step, exposed communication and peak memory,
on the profile's cluster or, with the what-if options, another one. They never import torch."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

import click

from planner.presentation.options import what_if_options
from planner.units import mib


@click.command()
@click.argument("profile_json")
@click.argument("plan_json", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--trace", "trace_out", help="Write the predicted timeline as a Chrome trace (open in Perfetto).")
@click.option("--png", "png_out", help="Draw the predicted timeline with matplotlib (with a plan: FSDP2's default "
                                         "above it, on one time axis).")
@what_if_options
def simulate(profile_json, plan_json, as_json, trace_out, png_out, **what_if) -> None:
    """Predict step ms, exposed communication and peak memory of a plan (default: FSDP2's default); with --target,
    the step's band and what it rests on."""
    from planner.artifacts.plan import Plan
    from planner.artifacts.profile import Profile
    from planner.simulation.what_if import WhatIf

    scenario = WhatIf(**what_if).apply(Profile.load(profile_json))
    deepened, target, retargeted = scenario.deepened, scenario.target, scenario.retargeted
    plan = Plan.load(plan_json) if plan_json else Plan.default(scenario.profile)
    travelled = plan.check_matches(scenario.profile)
    if travelled is not None:
        click.echo(f"warning: {travelled}", err=True)
    priced = scenario.price(plan, trace=bool(trace_out or png_out))
    r, band = priced.result, priced.band
    title = f"{Path(plan_json).name if plan_json else 'FSDP2 default'} on {Path(profile_json).name}"
    if trace_out:
        from planner.simulation.trace import write_chrome_trace

        write_chrome_trace(r, trace_out, title)
    if png_out and plan_json:
        from planner.simulation.trace import write_comparison_png

        default = scenario.simulator().run(Plan.default(scenario.simulated), trace=True)
        write_comparison_png([("FSDP2 default", default), (Path(plan_json).name, r)], png_out)
    elif png_out:
        from planner.simulation.trace import write_png

        write_png(r, png_out, title)
    if as_json:
        figures = {"step_ms": r.step_ms, "exposed_comm_ms": r.exposed_comm_ms, "peak_bytes": r.peak_bytes,
                   "lower_bound_ms": r.lower_bound_ms}
        if deepened is not None:
            figures.update(depth=dataclasses.asdict(deepened.report))
        if retargeted is not None:
            figures.update(target=target.model_dump(), band_ms=[band.low_ms, band.high_ms],
                           band_parts={p.name: [p.low_ms, p.high_ms] for p in band.parts},
                           band_dominant=band.dominant.name,
                           link_fit={k: dataclasses.asdict(f) for k, f in retargeted.fits.items()},
                           extrapolation={**dataclasses.asdict(retargeted.extrapolation),
                                          "within_fit": retargeted.extrapolation.within_fit})
        click.echo(json.dumps(figures))
        return
    if deepened is not None:
        click.echo(f"depth         {deepened.report.describe()}")
    if retargeted is not None:
        _print_target(target, retargeted)
    _print_result(r, band)


def _print_target(target, retargeted) -> None:
    from planner.simulation.link import link_efficiency

    click.echo(f"target        {target.describe()}")
    click.echo(f"distance      {retargeted.extrapolation.describe()}")
    click.echo("collectives   from bytes on the wire:")
    shard = target.groups[0]
    for f in retargeted.fits.values():
        if not f.points:
            click.echo(f"  {f.kind.replace('_', '-'):15s} none recorded (one GPU): the target's link and latency alone")
            continue
        basis = ("fitted on" if f.identifiable else "one size: no overhead told apart, from") + (
            f" {f.points} recorded calls")
        click.echo(f"  {f.kind.replace('_', '-'):15s} per-call overhead {f.overhead_ms:.2f} ms, recorded "
                   f"{f.bytes_per_s * 8 / 1e9:.2f} Gbit/s effective ({basis}); on the target at "
                   f"{link_efficiency(f.kind, target.backend, shard.size // shard.nodes):.0%} of the link's rate")


def _print_result(r, band) -> None:
    if band is not None:
        click.echo(f"step          {r.step_ms:10.1f} ms  band [{band.low_ms:.1f}, {band.high_ms:.1f}] ms")
        for p in band.parts:
            lead = "dominates:" if p is band.dominant else "          "
            click.echo(f"  {lead} {p.name:<9} -{p.low_ms:.1f}/+{p.high_ms:.1f} ms  {p.detail}")
    else:
        click.echo(f"step          {r.step_ms:10.1f} ms")
    click.echo(f"exposed comm  {r.exposed_comm_ms:10.1f} ms")
    click.echo(f"peak memory   {mib(r.peak_bytes, unit=False):>10} MiB")
    click.echo(f"lower bound   {r.lower_bound_ms:10.1f} ms  (step / bound = {r.ratio_to_lower_bound:.3f})")



@click.command("presets")
def presets_command() -> None:
    """List the cluster presets --target takes, with where their figures come from."""
    from planner.artifacts.target import load_target, presets

    for name, source in presets().items():
        click.echo(f"{name:<20} {load_target(name).describe().split(': ', 1)[1]}")
        click.echo(textwrap.fill(source, width=120, initial_indent=" " * 21, subsequent_indent=" " * 21))

