"""Benchmark, offline: the CPU overlap slowdown solved from one async plan's measured step, on saved fidelity runs.

    python -m bench.overlap_anchor bench/results/fidelity-*-cpu-*.json [--anchor "uniform depth 1 async"]

The simulator took ``overlap_slowdown`` from the recorder's microbenchmark (an all-gather and matrix multiplies
alone and at once: 1.8-2.0 on the 2-core testbed), and the async plans were then predicted too slow
(bench/results/NOTES.md: compute beside an all-gather inside a step slowed about 1.4). This asked, before the
recorder timed one, whether one measured async step would fix it (the rule ``tune`` now uses on CPU:
``planner.simulation.in_step.solve_overlap_slowdown``). Per saved ``bench.fidelity`` run, ``comm_scale`` is solved
from the default step as ``tune`` solves it (``planner.simulation.in_step.in_step_params``; on CPU the default
overlaps nothing, so it does not depend on the slowdown), then the slowdown by bisection in [1, 2] so that the
anchor plan's predicted step equals the recorder's default step times the anchor's measured ratio to the default
(the median step of each, from the run's interleaved rounds). Every other plan (the default and the anchor left
out) is then predicted both ways and printed: the median and max |error|, the same for each plan's ratio to the
default, and the signed median of that error over the async plans. The anchor's ratio here is a fidelity run's
median over 9-15 rounds, less noisy than a recorder's few steps would be. Measures nothing.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import click

ANCHOR = "uniform depth 0 async"


def anchored(run: dict, anchor: str = ANCHOR) -> dict:
    """One saved fidelity run: the held-out errors with the microbenchmark's slowdown and with the anchored one.

    Raises:
        KeyError: the run has no plan named ``anchor`` or no in-step timings.
    """
    from planner.artifacts.plan import Plan
    from planner.artifacts.profile import Profile
    from planner.simulation.in_step import in_step_params, solve_overlap_slowdown
    from planner.simulation.simulator import Simulator

    profile = dataclasses.replace(Profile.from_dict(run["profile"]), calibration=None)
    if profile.in_step is None:
        raise KeyError("the run's profile has no in-step timings")
    rows = run["rows"]
    names = [r["plan"] for r in rows]
    plans = [Plan.from_dict(r["plan_json"]) for r in rows]
    measured = [statistics.median(r["steps_ms"]) for r in rows]
    a = names.index(anchor)
    params = in_step_params(profile)
    simulator = Simulator(profile, params)
    compiled = [simulator.compile(p) for p in plans]
    target = profile.in_step.default_step_ms * measured[a] / measured[0]
    out = {"study": run["study"], "anchor": anchor, "anchor_ratio": measured[a] / measured[0]}
    held = [i for i in range(len(plans)) if i not in (0, a)]
    for label, p in (("microbenchmark", params),
                     ("anchored", dataclasses.replace(params, overlap_slowdown=solve_overlap_slowdown(
                         profile, params, target, plans[a])))):
        predicted = [simulator.run(c, p).step_ms for c in compiled]
        errors = [100 * abs(predicted[i] / measured[i] - 1) for i in held]
        relative = [100 * ((predicted[i] / predicted[0]) / (measured[i] / measured[0]) - 1) for i in held]
        out[label] = {"overlap_slowdown": p.overlap_slowdown, "median_abs_error_pct": statistics.median(errors),
                      "max_abs_error_pct": max(errors),
                      "median_abs_relative_pct": statistics.median(abs(x) for x in relative),
                      "max_abs_relative_pct": max(abs(x) for x in relative),
                      "async_relative_signed_pct": statistics.median(
                          x for x, i in zip(relative, held, strict=True) if plans[i].unshard_async_op)}
    return out


@click.command(help=__doc__)
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--anchor", default=ANCHOR, show_default=True, help="the plan (a row name) the slowdown is solved from")
def main(runs: tuple[str, ...], anchor: str) -> None:
    print(f"anchor: {anchor}; per run, the plans other than the default and the anchor: |error| median (max), "
          "|error| of the ratio to the default median (max), the async plans' signed ratio error (median)")
    for path in runs:
        try:
            r = anchored(json.loads(Path(path).read_text()), anchor)
        except (KeyError, ValueError) as e:
            print(f"{Path(path).name}: skipped ({e})")
            continue
        cells = [f"{label} s {f['overlap_slowdown']:.2f}: {f['median_abs_error_pct']:.1f}% "
                 f"({f['max_abs_error_pct']:.1f}%), {f['median_abs_relative_pct']:.1f}% "
                 f"({f['max_abs_relative_pct']:.1f}%), {f['async_relative_signed_pct']:+.1f}%"
                 for label, f in ((k, r[k]) for k in ("microbenchmark", "anchored"))]
        print(f"{Path(path).stem} (anchor at x{r['anchor_ratio']:.3f}): " + " | ".join(cells))


if __name__ == "__main__":
    main()
