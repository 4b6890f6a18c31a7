"""Benchmark: does FSDP2's default step depend on what the process ran before it?

    python -m bench.step_history [bench/llama-cpu-ac-full.toml] [--rounds 5]
        [--blocks alone,beside,alone,beside | alone:20,all:2,alone:10] [--json out.json]

On the study's ranks, in ``tune``'s process state (``bench.ranks.as_tune_ranks``): ``record_profile`` with the
study's settings, its timed steps logged (``runtime.recorder._timed_step``: the async pairs, then the default's
timed steps, [Note: The default's step is timed last]); then ``--blocks`` in order, each ``--rounds`` rounds (or
``BLOCK:ROUNDS``) of :func:`runtime.measure.measure_plans` (one warm-up step a plan, then interleaved rounds, each
step's max across ranks): ``alone``, FSDP2's default by itself; ``beside``, the default and the same plan with every
block kept unsharded after forward (``bench.fidelity.without_reshard``), which holds more memory through the
forward; ``all``, ``bench.fidelity``'s 15 plans, the default first, as its rounds run them.

Rank 0 prints the recorder's default step and its logged steps, then per block the default's median, its steps,
and per step rank 0's own process CPU ms (``getrusage``, every thread: compute, gloo's and autograd's threads), of
them the kernel's, and its minor page faults. A default that reads the same in every block does not depend on what
ran before it; CPU ms that move with the step say the process did more or less work, not that it waited for a core,
and kernel ms that move with the faults say the work was page faults. On the 2-core CPU testbed with glibc's
allocator the default read 5-19% lower after one round of ``all`` than alone before it in three processes of three,
0.25-0.41 million faults a step fewer, and a sampling profile put the kernel's fault work at all of the difference;
under ``[launch] allocator = "jemalloc"`` it took no fault and read the same in every block (bench/results/NOTES.md,
"The level is the page faults after all"). Run the process alone on the machine.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click

from bench.ranks import as_tune_ranks, json_flag, run_studies
from runtime.process_usage import ProcessUsage, process_usage

MODULE = "bench.step_history"
BLOCKS = ("alone", "beside", "all")


def rank_main(study: str, rounds: int, blocks: list[tuple[str, int | None]], json_out: str | None) -> None:
    """Every rank: record, then the blocks of rounds; rank 0 prints (and writes ``json_out``)."""
    as_tune_ranks()
    import torch.distributed as dist

    import runtime.measure as measure
    import runtime.recorder as recorder
    from bench.fidelity import fidelity_plans, without_reshard
    from planner.artifacts.config import load_study_config
    from planner.artifacts.plan import Plan
    from runtime.rank import init_rank, shutdown_rank
    from runtime.workload import build_study_workload

    config = load_study_config(study)
    mesh = init_rank(config.launch.backend)
    workload = build_study_workload(config.workload, mesh)
    logged: list[tuple[float, float, float, float, int]] = []  # (s since the recording began, ms, CPU ms, kernel ms,
    #                                                             faults)
    usage: list[ProcessUsage] = []  # per step of the blocks, in the order they ran
    timed_step, rounds_step = recorder._timed_step, measure.timed_step
    t0 = time.perf_counter()

    def logging_step(w, step, device):
        before = process_usage()
        out = timed_step(w, step, device)
        used = process_usage() - before
        logged.append((time.perf_counter() - t0, out[0], used.cpu_ms, used.system_ms, used.faults))
        return out

    def counting_step(w, step):
        before = process_usage()
        ms = rounds_step(w, step)
        usage.append(process_usage() - before)
        return ms

    recorder._timed_step, measure.timed_step = logging_step, counting_step
    try:
        profile = recorder.record_profile(workload, warmup_steps=1, steps=config.measure.steps,
                                          repeats=config.measure.profile_repeats)
        default = Plan.default(profile)
        neighbours = {"alone": [default], "beside": [default, without_reshard(profile, default)],
                      "all": list(fidelity_plans(profile).values()) if any(b == "all" for b, _ in blocks) else []}
        rows = []
        for block, block_rounds in blocks:
            start, first = time.perf_counter() - t0, len(usage)
            plans = neighbours[block]
            step_ms = measure.measure_plans(workload, plans, block_rounds or rounds)
            own = usage[first::len(plans)]  # the default's steps (it runs first in each round; warm-ups untimed)
            rows.append({"block": block, "start_s": start, "default_ms": step_ms[0] if step_ms else [],
                         "others_ms": [statistics.median(ms) for ms in step_ms[1:] if ms],
                         "default_cpu_ms": [u.cpu_ms for u in own], "default_system_ms": [u.system_ms for u in own],
                         "default_faults": [u.faults for u in own]})
    finally:
        recorder._timed_step, measure.timed_step = timed_step, rounds_step
    if dist.get_rank() == 0:
        _print(config.name, profile.in_step.default_step_ms, logged, rows)
        if json_out:
            Path(json_out).write_text(json.dumps({"study": config.name, "recorder_default_ms":
                                                  profile.in_step.default_step_ms, "recorder_steps": logged,
                                                  "blocks": rows}, indent=1))
    del workload
    shutdown_rank()


def _print(name: str, recorder_ms: float, logged: list, rows: list[dict]) -> None:
    """Rank 0's report: the recorder's steps, then per block the default's steps with their CPU ms and faults."""
    print(f"\n{name}: the recorder's default {recorder_ms:.1f} ms; its timed steps (s, ms, CPU ms, kernel ms, "
          f"faults): {[(round(t), round(ms), round(c), round(k), f) for t, ms, c, k, f in logged]}")
    for row in rows:
        cells = (f"default {statistics.median(row['default_ms']):.0f} ms, CPU "
                 f"{statistics.median(row['default_cpu_ms']):.0f} ms (in the kernel "
                 f"{statistics.median(row['default_system_ms']):.0f}), "
                 f"{statistics.median(row['default_faults']) / 1e3:.0f}k faults (medians); steps "
                 f"{[round(x) for x in row['default_ms']]}")
        if row["others_ms"]:
            cells += f"; the other plans' medians {statistics.median(row['others_ms']):.0f}"
        print(f"{row['block']:>7} at {row['start_s']:4.0f} s: {cells}")


def parse_blocks(text: str) -> list[tuple[str, int | None]]:
    """``"alone:20,all:2,alone"`` -> ``[("alone", 20), ("all", 2), ("alone", None)]`` (``None``: ``--rounds``).

    Raises:
        click.BadParameter: a block other than ``alone``, ``beside`` or ``all``, or rounds that are not a positive
            whole number.
    """
    blocks = []
    for item in (b.strip() for b in text.split(",")):
        if not item:
            continue
        name, _, count = item.partition(":")
        if name not in BLOCKS or (count and not (count.isdigit() and int(count) > 0)):
            raise click.BadParameter(f"bad block {item!r}: give alone, beside or all, each with an optional "
                                     f":ROUNDS (a positive whole number), comma-separated", param_hint="--blocks")
        blocks.append((name, int(count) if count else None))
    if not blocks:
        raise click.BadParameter("no blocks: give alone, beside or all, comma-separated", param_hint="--blocks")
    return blocks


@click.command(help=__doc__)
@click.argument("study", default="bench/llama-cpu-ac-full.toml", type=click.Path(dir_okay=False))
@click.option("--rounds", default=5, show_default=True, type=click.IntRange(1), help="rounds a block")
@click.option("--blocks", default="alone,beside,alone,beside", show_default=True,
              help="the blocks, in order: alone, beside, all, each with an optional :ROUNDS")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="also write the run as JSON here")
def main(study: str, rounds: int, blocks: str, json_out: str | None) -> None:
    order = parse_blocks(blocks)
    forward = [study, "--rounds", str(rounds), "--blocks", blocks] + json_flag(json_out)
    run_studies(MODULE, [study], lambda _: forward, lambda s: rank_main(s, rounds, order, json_out))


if __name__ == "__main__":
    main()
