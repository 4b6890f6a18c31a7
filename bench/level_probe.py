"""Benchmark: when FSDP2's default step changes level over minutes, do fixed probes of the machine change with it?

    python -m bench.level_probe [bench/llama-cpu-ac-selective-jemalloc.toml] [--minutes 8] [--window-s 30]
        [--json out.json]
    python -m bench.level_probe --refit out.json

On the study's ranks (its launch, allocator included), in ``tune``'s process state: three warm-up steps of FSDP2's
default and one call of each probe, then for ``--minutes`` an iteration after another, each the default's training
step and then five fixed probes, every one after a barrier and timed on every rank (the iteration's figure is the max
across ranks, as a step's is). The probes touch neither the model nor FSDP2:

- ``matmul_cache``: 60 matrix products of 384 x 384, in cache (the cores' speed);
- ``matmul_weights``: the model's own product shape, tokens x hidden by a hidden x intermediate weight (the study's
  ``batch_size`` x ``seq_len``, ``hidden_size``, ``intermediate_size``, the reference Llama's defaults where one is
  absent: 64 x 1024 by 1024 x 2816), over 8 weights in turn (92 MB: each product streams its weight from memory, as
  the step's products do);
- ``copy``: a 50 MiB tensor copied into another eight times (memory bandwidth);
- ``fresh``: a fresh 50 MiB tensor filled, six times (the allocator and, under glibc, the kernel's page faults);
- ``all_gather``: gloo's all-gather of a 25 MiB shard into a preallocated 50 MiB output, twice (loopback sockets).

The run is cut into windows of ``--window-s`` seconds. Per series, each window's level is its median over the run's
median; rank 0 prints, per series, the levels' standard deviation and range, their lag-1 autocorrelation, and their
Pearson correlation with the step's levels (windows are autocorrelated, so a p-value would be optimistic and is not
printed). A probe that moves as the step does, as far, names the part of the machine whose level the step follows;
probes that stay flat while the step moves put the move in the step's own path (FSDP2, gloo, the allocator).

Why: on the 2-core CPU testbed the default's level moved 10-30% over minutes in one process, with no page fault
under jemalloc and the process's CPU ms moving with it, and that move is most of the uncalibrated step error of
issue 21 (bench/results/NOTES.md, "A guard for the anchor"). In six 8-minute processes of the plain Llama under glibc
and the selective one under jemalloc, the step's window levels moved with a 4.5-6.1% sd, and the products of the
model's shape followed them in five (r 0.79-0.84); the copy and the all-gather less (NOTES, "Probes of the machine
beside the step"). Run the process alone on the machine.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import click

from bench.anchor_level import pooled_lag1
from bench.ranks import as_tune_ranks, json_flag, run_studies
from bench.saved_runs import read_saved

MODULE = "bench.level_probe"
STEP = "step"
MIB = 1 << 20


def rank_main(study: str, minutes: float, window_s: float, json_out: str | None) -> None:
    """Every rank: warm up, then iterations of the default's step and the probes; rank 0 reports."""
    as_tune_ranks()
    import torch
    import torch.distributed as dist

    from planner.artifacts.config import load_study_config
    from runtime.measure import StepCounter, timed_step
    from runtime.rank import init_rank, shutdown_rank
    from runtime.workload import build_study_workload

    config = load_study_config(study)
    mesh = init_rank(config.launch.backend)
    workload = build_study_workload(config.workload, mesh)
    kwargs = dict(config.workload.kwargs)
    hidden, inner = int(kwargs.get("hidden_size", 1024)), int(kwargs.get("intermediate_size", 2816))
    tokens = int(kwargs.get("batch_size", 1)) * int(kwargs.get("seq_len", 64))
    world = dist.get_world_size()
    a, b, out = torch.randn(384, 384), torch.randn(384, 384), torch.empty(384, 384)
    x, y = torch.randn(tokens, hidden), torch.empty(tokens, inner)
    weights = [torch.randn(hidden, inner) for _ in range(8)]
    src, dst = torch.randn(50 * MIB // 4), torch.empty(50 * MIB // 4)
    shard = torch.randn(50 * MIB // 4 // world)
    gathered = torch.empty(shard.numel() * world)
    # all_gather_single replaces the deprecated all_gather_into_tensor in newer torch
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def matmul_cache():
        for _ in range(60):
            torch.mm(a, b, out=out)

    def matmul_weights():
        for w in weights + weights:
            torch.mm(x, w, out=y)

    def copy():
        for _ in range(8):
            dst.copy_(src)

    def fresh():
        for _ in range(6):
            torch.empty(50 * MIB // 4).fill_(1.0)

    def all_gather():
        for _ in range(2):
            gather(gathered, shard)

    probes = {"matmul_cache": matmul_cache, "matmul_weights": matmul_weights, "copy": copy, "fresh": fresh,
              "all_gather": all_gather}
    counter = StepCounter()
    for _ in range(3):  # warm-up: the model's steps, and each probe's first touch of its buffers
        timed_step(workload, counter.next())
    for probe in probes.values():
        probe()
    t_start: list[float] = []
    series: dict[str, list[float]] = {name: [] for name in (STEP, *probes)}
    t0 = time.perf_counter()
    stop = torch.zeros(1)
    while True:
        t_start.append(time.perf_counter() - t0)
        series[STEP].append(timed_step(workload, counter.next()))
        for name, probe in probes.items():
            dist.barrier()
            t = time.perf_counter()
            probe()
            series[name].append((time.perf_counter() - t) * 1e3)
        stop.fill_(float(time.perf_counter() - t0 >= minutes * 60))  # rank 0's clock decides for all
        dist.broadcast(stop, 0)
        if stop.item():
            break
    per_rank: list[dict] = [{}] * world
    dist.all_gather_object(per_rank, series)
    if dist.get_rank() == 0:
        run = {"study": config.name, "allocator": config.launch.allocator.value, "window_s": window_s,
               "start_s": t_start,
               "series": {name: [max(r[name][i] for r in per_rank) for i in range(len(t_start))]
                          for name in series}}
        _report(run)
        if json_out:
            Path(json_out).write_text(json.dumps(run, indent=1))
    del workload
    shutdown_rank()


@dataclass(frozen=True)
class SeriesLevels:
    """One series' window levels over a run.

    Attributes:
        name: ``"step"`` or a probe's name.
        median_ms: the series' median over the run, ms.
        levels: per window, the window's median over ``median_ms``.
        correlation_with_step: Pearson's r of ``levels`` with the step's levels (1.0 for the step; ``nan`` when a
            series is constant).
    """

    name: str
    median_ms: float
    levels: tuple[float, ...]
    correlation_with_step: float

    @property
    def sd(self) -> float:
        """The levels' sample standard deviation (0 with fewer than two windows)."""
        return statistics.stdev(self.levels) if len(self.levels) > 1 else 0.0

    @property
    def lag1(self) -> float:
        """The levels' lag-1 autocorrelation (``bench.anchor_level.pooled_lag1`` of this one series; ``nan`` with
        fewer than two windows or a constant series)."""
        return pooled_lag1([self.levels]) if len(self.levels) > 1 else math.nan


def window_levels(start_s: list[float], values: list[float], window_s: float) -> list[float]:
    """Per window of ``window_s`` seconds (by each iteration's start), the window's median over the series' median.

    Shapes: ``start_s`` and ``values`` one per iteration, in order; windows with no iteration are skipped, and a last
    window shorter than half of ``window_s`` is merged into the one before, so that no level rests on a few steps.

    Raises:
        ValueError: ``start_s`` and ``values`` differ in length, or are empty, or ``window_s`` is not positive.
    """
    if len(start_s) != len(values) or not values:
        raise ValueError(f"need one start per value, and at least one: {len(start_s)} starts, {len(values)} values")
    if window_s <= 0:
        raise ValueError(f"window_s must be positive, not {window_s}")
    end = start_s[-1]
    last_full = max(0, math.floor(end / window_s) - (1 if end % window_s < window_s / 2 else 0))
    groups: dict[int, list[float]] = {}
    for t, v in zip(start_s, values, strict=True):
        groups.setdefault(min(int(t // window_s), last_full), []).append(v)
    median = statistics.median(values)
    return [statistics.median(groups[k]) / median for k in sorted(groups)]


def series_levels(run: dict) -> list[SeriesLevels]:
    """Every series of a saved run (``rank_main``'s JSON), the step first, with its levels and correlation."""
    start, window = run["start_s"], run["window_s"]
    levels = {name: window_levels(start, values, window) for name, values in run["series"].items()}
    step = levels[STEP]
    return [SeriesLevels(name, statistics.median(values), tuple(levels[name]), _pearson(levels[name], step))
            for name, values in sorted(run["series"].items(), key=lambda kv: kv[0] != STEP)]


def read_run(path: str) -> dict:
    """A saved run (``rank_main``'s JSON), checked by computing its levels.

    Raises:
        KeyError, TypeError, ValueError: the file is not such a run (json's decode error is a ``ValueError``).
    """
    run = json.loads(Path(path).read_text())
    series_levels(run)
    return run


def _pearson(xs: list[float], ys: list[float]) -> float:
    """Pearson's r; ``nan`` when either side is constant or has fewer than three points."""
    if len(xs) < 3 or statistics.pstdev(xs) == 0 or statistics.pstdev(ys) == 0:
        return math.nan
    return statistics.correlation(xs, ys)


def _report(run: dict) -> None:
    """Rank 0's (or ``--refit``'s) table: per series its median, the levels' sd, range, lag-1 and r with the step."""
    rows = series_levels(run)
    n = len(run["start_s"])
    print(f"\n{run['study']} ({run.get('allocator', '?')}): {n} iterations over {run['start_s'][-1]:.0f} s, "
          f"{len(rows[0].levels)} windows of {run['window_s']:.0f} s")
    print(f"{'series':>15} {'median ms':>10} {'level sd':>9} {'range':>13} {'lag-1':>6} {'r with step':>12}")
    for s in rows:
        print(f"{s.name:>15} {s.median_ms:10.1f} {s.sd:9.1%} {min(s.levels):6.3f}-{max(s.levels):.3f} "
              f"{s.lag1:6.2f} {s.correlation_with_step:12.2f}")
    print("levels by window: " + "; ".join(f"{s.name} " + " ".join(f"{v:.2f}" for v in s.levels) for s in rows))


@click.command(help=__doc__)
@click.argument("study", default="bench/llama-cpu-ac-selective-jemalloc.toml", type=click.Path(dir_okay=False))
@click.option("--minutes", default=8.0, show_default=True, type=click.FloatRange(0.05), help="how long to probe")
@click.option("--window-s", default=30.0, show_default=True, type=click.FloatRange(1.0), help="seconds a window")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="also write the run as JSON here")
@click.option("--refit", multiple=True, type=click.Path(exists=True, dir_okay=False), metavar="JSON",
              help="report a saved --json run again, measuring nothing (repeatable)")
def main(study: str, minutes: float, window_s: float, json_out: str | None, refit: tuple[str, ...]) -> None:
    if refit:
        for run in read_saved(refit, read_run, "a saved `bench.level_probe --json` run",
                              "give the JSON a `python -m bench.level_probe --json` run wrote"):
            _report(run)
        return
    forward = [study, "--minutes", str(minutes), "--window-s", str(window_s)] + json_flag(json_out)
    run_studies(MODULE, [study], lambda _: forward, lambda s: rank_main(s, minutes, window_s, json_out))


if __name__ == "__main__":
    main()
