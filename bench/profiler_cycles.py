"""Benchmark: does ``torch.profiler`` slow the step it traces, and does that depend on the cycle's length?

    python -m bench.profiler_cycles [studies/llama-cpu.toml] [--steps 8] [--order untraced,cycles,long,untraced]

On the study's ranks, one model, a plain loop (``train_step``), each step timed between barriers (ms, rank 0's
clock), in blocks of ``--steps`` steps, in ``--order`` (rotate it between launches: this testbed drifts):
``untraced``; ``long``, one profiler cycle of ``--steps`` active steps (``schedule(wait=0, warmup=1,
active=steps)``); ``cycles``, ``--steps`` cycles of one untraced step, one warm-up and one active step
(``schedule(wait=1, warmup=1, active=1, repeat=steps)``, torchtitan's shape). The profiler as
``bench.trace_profile`` runs it: the CPU activity (and CUDA's on GPU), ``profile_memory`` and ``record_shapes``.
Prints each block's steps and median, and, per cycle, the active step over the untraced step just before it:
their median and range ([Note: Several traces of one rank] in ``planner/traces/trace_profile.py``).
"""

from __future__ import annotations

import statistics
import tempfile
import time

import click

from bench.ranks import run_studies, studies_argument, user_profiler

MODULE = "bench.profiler_cycles"
BLOCKS = ("untraced", "long", "cycles")


def rank_main(study: str, steps: int, order: list[str]) -> None:
    """Every rank: the blocks in ``order``; rank 0 prints."""
    import torch
    import torch.distributed as dist

    from planner.artifacts.config import load_study_config
    from runtime.rank import init_rank, shutdown_rank
    from runtime.workload import build_study_workload, train_step

    config = load_study_config(study)
    mesh = init_rank(config.launch.backend)
    workload = build_study_workload(config.workload, mesh)
    counter = iter(range(10**9))

    def timed() -> float:
        dist.barrier()
        start = time.perf_counter()
        train_step(workload, next(counter))
        if mesh.device_type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        return (time.perf_counter() - start) * 1e3

    def profiled(schedule, n: int) -> list[float]:
        out = []
        with user_profiler(mesh.device_type, tempfile.mkdtemp(), schedule) as prof:
            for _ in range(n):
                out.append(timed())
                prof.step()
        return out

    for _ in range(2):
        timed()
    rows: list[tuple[str, list[float]]] = []
    pairs: list[float] = []
    for block in order:
        if block == "untraced":
            rows.append(("untraced", [timed() for _ in range(steps)]))
        elif block == "long":
            rows.append((f"one cycle of {steps} active", profiled(
                torch.profiler.schedule(wait=0, warmup=1, active=steps), steps + 1)[1:]))
        else:
            times = profiled(torch.profiler.schedule(wait=1, warmup=1, active=1, repeat=steps), 3 * steps)
            rows += [("cycles: untraced step", times[0::3]), ("cycles: warm-up step", times[1::3]),
                     ("cycles: active step", times[2::3])]
            pairs += [a / w for w, a in zip(times[0::3], times[2::3], strict=True)]
    if dist.get_rank() == 0:
        print(f"\n== {config.name}: step ms, {steps} steps a block, in the order run")
        for name, times in rows:
            print(f"{name:<26}" + " ".join(f"{t:7.0f}" for t in times) + f"   median {statistics.median(times):.0f}")
        if pairs:
            print(f"one active step a cycle over the untraced step before it: median {statistics.median(pairs):.3f} "
                  f"(range {min(pairs):.2f}-{max(pairs):.2f}, {len(pairs)} cycles)")
    shutdown_rank()


@click.command(help=__doc__)
@studies_argument
@click.option("--steps", default=8, show_default=True, help="steps a block, and cycles")
@click.option("--order", default="untraced,cycles,long,untraced", show_default=True,
              help=f"the blocks, comma-separated, from {', '.join(BLOCKS)}")
def main(studies: tuple[str, ...], steps: int, order: str) -> None:
    blocks = [b.strip() for b in order.split(",") if b.strip()]
    if unknown := [b for b in blocks if b not in BLOCKS]:
        raise click.BadParameter(f"unknown blocks {unknown}; use {', '.join(BLOCKS)}", param_hint="--order")
    run_studies(MODULE, studies or ("studies/llama-cpu.toml",),
                lambda study: [study, "--steps", str(steps), "--order", ",".join(blocks)],
                lambda study: rank_main(study, steps, blocks))


if __name__ == "__main__":
    main()
