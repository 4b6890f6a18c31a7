"""Benchmark: does FSDP2's default step depend on what the process ran before it?

    python -m bench.step_history [bench/llama-cpu-ac-full.toml] [--rounds 5] [--blocks alone,beside,alone,beside]
        [--json out.json]

On the study's ranks, in ``tune``'s process state (``bench.ranks.as_tune_ranks``): ``record_profile`` with the
study's settings, its timed steps logged (``runtime.recorder._timed_step``: the async pairs, then the default's
timed steps, [Note: The default's step is timed last]); then ``--blocks`` in order, each ``--rounds`` rounds of
:func:`runtime.measure.measure_plans` (one warm-up step a plan, then interleaved rounds, each step's max across
ranks): ``alone``, FSDP2's default by itself; ``beside``, the default and the same plan with every block kept
unsharded after forward (``bench.fidelity.without_reshard``), which holds more memory through the
forward.

Rank 0 prints the recorder's default step and its logged steps (seconds since the recording began, ms), then per
block the default's median and steps, and the neighbour's. A default that reads the same in every block does not
depend on its neighbours. On the 2-core CPU testbed, in one process of three, it read 19% lower after one block
beside and stayed there alone (bench/results/NOTES.md, "The default's step, timed last ..., and the rounds'
level"). Run the process alone on the machine. Launch under ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` to pin glibc's heap.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click

from bench.ranks import as_tune_ranks, json_flag, run_studies

MODULE = "bench.step_history"
BLOCKS = ("alone", "beside")


def rank_main(study: str, rounds: int, blocks: list[str], json_out: str | None) -> None:
    """Every rank: record, then the blocks of rounds; rank 0 prints (and writes ``json_out``)."""
    as_tune_ranks()
    import torch.distributed as dist

    import runtime.recorder as recorder
    from bench.fidelity import without_reshard
    from planner.artifacts.config import load_study_config
    from planner.artifacts.plan import Plan
    from runtime.measure import measure_plans
    from runtime.rank import init_rank, shutdown_rank
    from runtime.workload import build_study_workload

    config = load_study_config(study)
    mesh = init_rank(config.launch.backend)
    workload = build_study_workload(config.workload, mesh)
    logged: list[tuple[float, float]] = []
    timed_step = recorder._timed_step
    t0 = time.perf_counter()

    def logging_step(w, step, device):
        out = timed_step(w, step, device)
        logged.append((time.perf_counter() - t0, out[0]))
        return out

    recorder._timed_step = logging_step
    try:
        profile = recorder.record_profile(workload, warmup_steps=1, steps=config.measure.steps,
                                          repeats=config.measure.profile_repeats)
    finally:
        recorder._timed_step = timed_step
    default = Plan.default(profile)
    beside = without_reshard(profile, default)
    rows = []
    for block in blocks:
        start = time.perf_counter() - t0
        step_ms = measure_plans(workload, [default] if block == "alone" else [default, beside], rounds)
        rows.append({"block": block, "start_s": start, "default_ms": step_ms[0] if step_ms else [],
                     "beside_ms": step_ms[1] if len(step_ms) > 1 else []})
    if dist.get_rank() == 0:
        print(f"\n{config.name}: the recorder's default {profile.in_step.default_step_ms:.1f} ms; its timed steps "
              f"(s, ms): {[(round(t), round(ms)) for t, ms in logged]}")
        for row in rows:
            cells = f"default {statistics.median(row['default_ms']):.0f} {[round(x) for x in row['default_ms']]}"
            if row["beside_ms"]:
                cells += f"; beside it {statistics.median(row['beside_ms']):.0f}"
            print(f"{row['block']:>7} at {row['start_s']:4.0f} s: {cells}")
        if json_out:
            Path(json_out).write_text(json.dumps({"study": config.name, "recorder_default_ms":
                                                  profile.in_step.default_step_ms, "recorder_steps": logged,
                                                  "blocks": rows}, indent=1))
    del workload
    shutdown_rank()


def parse_blocks(text: str) -> list[str]:
    """``"alone,beside"`` -> ``["alone", "beside"]``.

    Raises:
        click.BadParameter: a block other than ``alone`` or ``beside``.
    """
    blocks = [b.strip() for b in text.split(",") if b.strip()]
    bad = [b for b in blocks if b not in BLOCKS]
    if bad or not blocks:
        raise click.BadParameter(f"bad blocks {text!r}: give alone and beside, comma-separated", param_hint="--blocks")
    return blocks


@click.command(help=__doc__)
@click.argument("study", default="bench/llama-cpu-ac-full.toml", type=click.Path(dir_okay=False))
@click.option("--rounds", default=5, show_default=True, type=click.IntRange(1), help="rounds a block")
@click.option("--blocks", default="alone,beside,alone,beside", show_default=True, help="the blocks, in order")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="also write the run as JSON here")
def main(study: str, rounds: int, blocks: str, json_out: str | None) -> None:
    order = parse_blocks(blocks)
    forward = [study, "--rounds", str(rounds), "--blocks", ",".join(order)] + json_flag(json_out)
    run_studies(MODULE, [study], lambda _: forward, lambda s: rank_main(s, rounds, order, json_out))


if __name__ == "__main__":
    main()
