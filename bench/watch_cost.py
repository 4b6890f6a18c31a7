"""Benchmark: what the in-loop watch costs a step ([Note: What the watch costs a step] in runtime.in_loop.watching).

    python -m bench.watch_cost studies/llama-cpu.toml [--stretches 4] [--steps 32] [--json OUT]

On the study's ranks, one model: FSDP2's default watched as the in-loop tuner watches its survivor (the tuner's own
step runner and ``WatchedSteps``, blocks of the fewest steps the watch allows, so the most switches and reads a
step), against the same steps unwatched. The watched plan *is* FSDP2's default, so the two arms run the same
kernels and their difference is the mechanism alone: the events, the plan switches, the reads of a block's events
and rank 0's broadcast at each block's end. The arms alternate in stretches of ``--steps`` steps, the order rotated
pair by pair; each stretch's wall time is taken from an idle device on every rank together (synchronized, a
barrier) to an idle device (synchronized), the max across ranks. Reports the total-time ratio watched / plain with
its 95% interval within the process (the stretches paired; no spread between launches: one model, one process).

Two ranks sharing one GPU (``bash bench/gpu_two_ranks.sh``, stage ``watch-cost``) test the mechanism, not a
cluster's speed: a host that falls behind its device, which is what the broadcast would cost, looks different there.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from bench.ranks import json_flag, run_studies

MODULE = "bench.watch_cost"


def rank_main(study: str, stretches: int, steps: int, out: str | None) -> None:
    """Every rank: the two arms in alternating stretches; rank 0 prints the ratio and writes ``out``."""
    import torch.distributed as dist

    from planner.artifacts.config import load_study_config
    from planner.statistics.watch import MIN_EVERY, Watch, in_process
    from runtime.current import fsdp2_default
    from runtime.in_loop.watching import WatchedSteps
    from runtime.ranks.collectives import gather_max
    from runtime.ranks.device import device_of
    from runtime.ranks.rank import job_rank
    from runtime.recording.steps import StepSide
    from runtime.timing import StepCounter, device_type_of
    from runtime.workload import build_study_workload, train_step

    config = load_study_config(study)
    with job_rank(config.launch) as rank:
        workload = build_study_workload(config.workload, rank.mesh)
        device = device_of(device_type_of(workload))
        default = fsdp2_default(workload.model)
        side = StepSide(workload.model, device.type, rank.group, default)
        side.race([default, default], applied=0)  # the watched plan and the plan kept: the same
        watch = WatchedSteps(side, Watch(MIN_EVERY, seed=0), rank.rank0)
        counter = StepCounter()

        def plain() -> None:
            for _ in range(steps):
                train_step(workload, counter.next())

        def watched() -> None:
            for _ in range(steps):
                watch.before()
                train_step(workload, counter.next())
                watch.after()

        arms = {"plain": plain, "watched": watched}
        for run in arms.values():  # warm-up: the allocator, the first switches
            run()
        local: dict[str, list[float]] = {name: [] for name in arms}
        for s in range(stretches):
            for name in ("plain", "watched") if s % 2 == 0 else ("watched", "plain"):
                local[name].append(device.timed_ms(arms[name], rank.group))
        maxed, _ = gather_max(local["plain"] + local["watched"], rank.group)
        rank.ended = True
        world = dist.get_world_size()
        if not rank.rank0:
            return
        plain_ms, watched_ms = maxed[:stretches], maxed[stretches:]
        here = in_process(watched_ms, plain_ms)
        result = {"study": config.name, "device": device.type, "world_size": world,
                  "steps_per_stretch": steps, "stretches": stretches, "watch_every": MIN_EVERY,
                  "plain_ms": plain_ms, "watched_ms": watched_ms, "ratio": here.ratio, "ci95": list(here.ci95),
                  "blocks_read": watch.state.blocks}
        print(f"watch cost: watched / plain {here.ratio:.4f} [{here.ci95[0]:.4f}, {here.ci95[1]:.4f}] over "
              f"{stretches} stretches of {steps} steps each ({watch.state.blocks} watch blocks of {MIN_EVERY} steps "
              f"read), {device.type}, {world} ranks")
        if out:
            Path(out).write_text(json.dumps(result, indent=1))


@click.command(help=__doc__)
@click.argument("study")
@click.option("--stretches", default=4, show_default=True, help="Stretches of each arm, alternated (>= 4).")
@click.option("--steps", default=32, show_default=True, help="Steps per stretch.")
@click.option("--json", "json_out", default=None, help="Write rank 0's figures here.")
def main(study: str, stretches: int, steps: int, json_out: str | None) -> None:
    if stretches < 4:
        raise click.BadParameter("give 4 stretches or more (the interval needs them)", param_hint="--stretches")
    run_studies(MODULE, (study,), lambda s: [s, "--stretches", str(stretches), "--steps", str(steps),
                                             *json_flag(json_out)],
                lambda s: rank_main(s, stretches, steps, json_out))


if __name__ == "__main__":
    main()
