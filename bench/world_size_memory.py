"""Benchmark: FSDP2's default peak at a larger world size, predicted from a profile of a smaller one.

    prefetch-planner profile studies/llama-cpu.toml -o p2.json            # [launch] nproc_per_node = 2
    prefetch-planner profile llama-cpu-4.toml -o p4.json                   # the same study at 4 ranks
    python -m bench.world_size_memory p2.json p4.json [--json out.json]

The first profile is re-sharded for the second's world size on one node
(``simulate --target``: ``planner.simulation.link.retarget``, [Note: What
re-sharding changes] in ``planner.simulation.resharding``) and FSDP2's
default is simulated on it; the prediction is compared with the peak the
second profile's recorder measured (``measured_peak_bytes``), and, as the
simulator's own floor, with the peak simulated from the second profile
itself. Target: the prediction within 5% of the measured peak. Memory is
counted, not timed: other work on the machine does not move it.
"""

from __future__ import annotations

import json

import click

from planner.units import mib


def predicted_peaks(small_path: str, large_path: str) -> dict:
    """The large profile's measured peak, its own simulated peak, and the peak predicted from the small one, bytes.

    Raises:
        ValueError: the second profile has no measured peak, or is not of the same model.
    """
    from planner.artifacts.plan import Plan
    from planner.artifacts.profile import Profile
    from planner.artifacts.target import Target
    from planner.simulation.link import recorded_backend, retarget
    from planner.simulation.parameters import profile_params, simulator_for

    small, large = Profile.load(small_path), Profile.load(large_path)
    if large.measured_peak_bytes is None:
        raise ValueError(f"{large_path}: no measured peak; record it with `prefetch-planner profile`")
    difference = small.fingerprint.model_difference(large.fingerprint)
    if difference is not None:
        raise ValueError(f"the profiles are of different models: {difference}")
    world = large.fingerprint.world_size
    target = Target(world_size=world, ranks_per_node=world, backend=recorded_backend(small),
                    link={"intra_node": {"bandwidth": "recorded"}})
    retargeted = retarget(small, target)
    predicted = simulator_for(retargeted.profile, profile_params(small)).run(Plan.default(small)).peak_bytes
    own = simulator_for(large, profile_params(large)).run(Plan.default(large)).peak_bytes
    small_own = simulator_for(small, profile_params(small)).run(Plan.default(small)).peak_bytes
    steps = [b for r in large.per_rank for b in r.steps.peak_bytes]  # each rank's each measured step
    return {"small_world_size": small.fingerprint.world_size, "world_size": world,
            "rank_step_peaks_bytes": steps, "lowest_rank_step_error": predicted / min(steps) - 1 if steps else None,
            "small_measured_peak_bytes": small.measured_peak_bytes, "small_simulated_peak_bytes": small_own,
            "measured_peak_bytes": large.measured_peak_bytes, "simulated_peak_bytes": own,
            "predicted_peak_bytes": predicted, "error": predicted / large.measured_peak_bytes - 1,
            "simulator_error": own / large.measured_peak_bytes - 1,
            "measured_change_bytes": large.measured_peak_bytes - (small.measured_peak_bytes or 0),
            "predicted_change_bytes": predicted - small_own,
            "padded_exactly": retargeted.extrapolation.padded_exactly}


@click.command()
@click.argument("small_profile")
@click.argument("large_profile")
@click.option("--json", "json_out", help="Also write the figures as JSON.")
def main(small_profile: str, large_profile: str, json_out: str | None) -> None:
    """Predict LARGE_PROFILE's default peak from SMALL_PROFILE and compare it with the measured one."""
    r = predicted_peaks(small_profile, large_profile)
    def row(label: str, measured: int | None, simulated: int, note: str = "") -> str:
        shown = "" if measured is None else mib(measured, unit=False)
        return f"{label:<38} {shown:>10} {mib(simulated, unit=False):>10}  {note}"

    small, large = r["small_world_size"], r["world_size"]
    click.echo(f"{'peak, MiB':<38} {'measured':>10} {'simulated':>10}")
    click.echo(row(f"{small} ranks (the profile)", r["small_measured_peak_bytes"], r["small_simulated_peak_bytes"]))
    click.echo(row(f"{large} ranks, from its own profile", r["measured_peak_bytes"], r["simulated_peak_bytes"],
                   f"{r['simulator_error']:+.1%}"))
    click.echo(row(f"{large} ranks, predicted from {small} ranks", None, r["predicted_peak_bytes"],
                   f"{r['error']:+.1%} (target: within 5%)"))
    if r["rank_step_peaks_bytes"]:
        peaks = r["rank_step_peaks_bytes"]
        low = min(peaks)
        click.echo(f"each rank's each step at {large} ranks: {', '.join(mib(b, unit=False) for b in peaks)} MiB; the "
                   f"prediction against the lowest: {r['lowest_rank_step_error']:+.2%}; {sum(b > low for b in peaks)} "
                   f"of {len(peaks)} above it")
    click.echo(f"change of peak: measured {mib(r['measured_change_bytes'])}, predicted "
               f"{mib(r['predicted_change_bytes'])}"
               + ("" if r["padded_exactly"] else "; parameter rows not recorded: padding left out"))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
