"""Benchmark: does tuning inside the training loop pay for itself? A user's loop of N steps, without and with
``runtime.AutoTuner`` from a cold study, in separate processes, alternated.

    python -m bench.in_loop_payback studies/llama-cpu.toml [--steps 1000] [--pairs 1] [--at 300,1000] [--json OUT]

Each run is a fresh launch of the study's ranks with a fresh model: ``without`` runs the user's loop as it is
(FSDP2's default); ``with`` builds an ``AutoTuner`` with its defaults on a new, empty study and runs the same loop.
Runs alternate without, with, without, with, ... so that a drift of the machine hits both arms. Per run it
prints the loop's wall time (the first step to the last, every tuning cost inside: recording, the isolated
passes and the search between steps, the slower plans of the race). Per pair: the wall-time ratio with /
without, the steps spent tuning, the confirmed ratio, and the break-even step (the first step from which the
tuned run's cumulative time stays below the plain run's), the step from which the survivor ran watched in its own
process and how its watch ended, and the wall-time ratio over the first ``--at`` steps of the same runs.

After the ``with`` loop, the same process runs ``--overhead-rounds`` rounds of two steps on its tuned model, one
inside ``tuner.step()`` (the done phase) and one bare, the order alternating: the total-time ratio, with its
interval within the process (no spread between launches: one model, one process), is what the done-phase tuner
adds to a step.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

import click

from bench.ranks import run_studies

MODULE = "bench.in_loop_payback"


def rank_main(study: str, arm: str, steps: int, overhead_rounds: int, out: str) -> None:
    """Every rank: the user's loop for ``steps`` steps, without or with the tuner; rank 0 writes ``out``."""
    import contextlib
    import logging
    import time

    import torch.distributed as dist

    from planner.artifacts.config import load_study_config
    from runtime import AutoTuner
    from runtime.ranks.rank import job_rank
    from runtime.workload import build_study_workload

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = load_study_config(study)
    with job_rank(config.launch) as rank:
        mesh = rank.mesh
        workload = build_study_workload(config.workload, mesh)
        model, optimizer = workload.model, workload.optimizer
        loss_fn, make_batch = workload.loss_fn, workload.make_batch
        tmp = tempfile.mkdtemp(prefix="payback-")
        tuner = None
        if arm == "with":
            tuner = AutoTuner(model, study=config.name, storage=f"sqlite:///{tmp}/cold.db" if dist.get_rank() == 0
                              else None, plan_out=f"{tmp}/plan.json" if dist.get_rank() == 0 else None)

        def one_step(step: int) -> None:
            optimizer.zero_grad()
            loss_fn(model, make_batch(step)).backward()
            optimizer.step()

        step_ms, phases = [], []
        dist.barrier()
        start = time.perf_counter()
        for step in range(steps):
            t0 = time.perf_counter()
            phases.append(str(tuner.phase) if tuner else "none")
            with tuner.step() if tuner else contextlib.nullcontext():
                one_step(step)
            step_ms.append((time.perf_counter() - t0) * 1e3)
        dist.barrier()
        wall_s = time.perf_counter() - start
        overhead: list[tuple[float, float]] = []
        if tuner is not None and str(tuner.phase) == "done":  # a tuner still tuning would go on tuning here
            for r in range(overhead_rounds):
                pair = {}
                for inside in ((True, False) if r % 2 == 0 else (False, True)):
                    dist.barrier()
                    t0 = time.perf_counter()
                    with tuner.step() if inside else contextlib.nullcontext():
                        one_step(steps + 2 * r + int(inside))
                    pair[inside] = (time.perf_counter() - t0) * 1e3
                overhead.append((pair[True], pair[False]))
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {"step_ms": step_ms, "overhead": overhead})
        if dist.get_rank() == 0:
            c = tuner.confirmation if tuner else None
            result = {
                "arm": arm, "wall_s": wall_s, "phases": phases,
                "step_ms": [max(v) for v in zip(*(g["step_ms"] for g in gathered), strict=True)],
                "overhead": [[max(g["overhead"][i][0] for g in gathered), max(g["overhead"][i][1] for g in gathered)]
                             for i in range(len(overhead))],
                "steps_tuning": tuner.steps_tuning if tuner else 0,
                "watch": None if tuner is None or tuner.watch is None else {
                    "checks": tuner.watch.blocks, "steps": tuner.watch.steps, "ratio": tuner.watch.ratio,
                    "reverted": tuner.watch.reverted},
                "confirmation": None if c is None else {"ratio": c.ratio, "ci95": list(c.ci95), "rounds": c.rounds,
                                                        "verdict": str(c.verdict)},
            }
            Path(out).write_text(json.dumps(result))
        del workload
        rank.ended = True


def break_even(with_ms: list[float], without_ms: list[float]) -> int | None:
    """The first step (1-based count of steps run) from which the tuned run's cumulative time stays at or below
    the plain run's to the end; ``None`` if it never does."""
    cum_with = cum_without = 0.0
    below = []
    for a, b in zip(with_ms, without_ms, strict=True):
        cum_with += a
        cum_without += b
        below.append(cum_with <= cum_without)
    for k in range(len(below)):
        if all(below[k:]):
            return k + 1
    return None


def report(runs: list[dict], at: list[int] | None = None) -> dict:
    """Print the per-run and per-pair figures; the summary as a dict. ``at``: steps at which each pair's cumulative
    wall-time ratio is also given (from the same runs: the time of their first ``k`` steps)."""
    from planner.statistics.verdict import confirm

    print(f"\n{'run':>3} {'arm':<8} {'wall s':>8} {'steps tuning':>12} {'median step ms (last 100)':>26}")
    for i, r in enumerate(runs):
        print(f"{i:>3} {r['arm']:<8} {r['wall_s']:>8.1f} {r['steps_tuning']:>12} "
              f"{statistics.median(r['step_ms'][-100:]):>26.1f}")
    pairs = []
    for i in range(0, len(runs) - 1, 2):
        a, b = runs[i], runs[i + 1]
        without, with_ = (a, b) if a["arm"] == "without" else (b, a)
        c = with_["confirmation"]
        applied = with_["phases"].index("watching") if "watching" in with_["phases"] else None
        pairs.append({"ratio_wall": with_["wall_s"] / without["wall_s"], "steps_tuning": with_["steps_tuning"],
                      "confirmation": c, "break_even_step": break_even(with_["step_ms"], without["step_ms"]),
                      "applied_from_step": applied, "watch": with_.get("watch"),
                      "ratio_at": {k: sum(with_["step_ms"][:k]) / sum(without["step_ms"][:k])
                                   for k in (at or []) if k <= len(with_["step_ms"])}})
    print(f"\n{'pair':>4} {'wall with/without':>18} {'steps tuning':>12} {'confirmed ratio [95% CI]':>30} "
          f"{'break-even step':>15}")
    for i, p in enumerate(pairs):
        c = p["confirmation"]
        text = f"{c['ratio']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}] {c['verdict']}" if c else "none (dropped)"
        print(f"{i:>4} {p['ratio_wall']:>18.3f} {p['steps_tuning']:>12} {text:>30} {str(p['break_even_step']):>15}")
    for i, p in enumerate(pairs):
        w = p["watch"]
        where = (f"the survivor applied from step {p['applied_from_step']}, watched: ratio {w['ratio']:.3f} over "
                 f"{w['checks']} checks ({w['steps']} steps){', reverted' if w['reverted'] else ''}"
                 if p["applied_from_step"] is not None and w else "nothing applied in this process")
        ratios = ", ".join(f"{k} steps {r:.3f}" for k, r in p["ratio_at"].items())
        print(f"pair {i}: {where}; wall time with / without at {ratios}")
    overhead = [pair for r in runs if r["arm"] == "with" for pair in r["overhead"]]
    summary: dict = {"pairs": pairs}
    if len(overhead) >= 6:
        o = confirm([x for x, _ in overhead], [y for _, y in overhead], float("nan"))
        low, high = o.within_ci95
        summary["done_phase_overhead"] = {"ratio": o.ratio, "ci95": [low, high], "rounds": o.rounds}
        print(f"\ndone phase: total time inside tuner.step() / bare = {o.ratio:.3f} [{low:.3f}, {high:.3f}] (95% CI "
              f"within these processes, {o.rounds} paired rounds)")
    return summary


@click.command(help=__doc__)
@click.argument("study", type=click.Path(dir_okay=False))
@click.option("--steps", default=300, show_default=True, help="steps of the user's loop per run")
@click.option("--pairs", default=2, show_default=True, help="pairs of runs (without, with), alternated")
@click.option("--overhead-rounds", default=20, show_default=True,
              help="after the tuned loop: rounds of a done-phase step against a bare one")
@click.option("--at", default="300,1000", show_default=True,
              help="steps at which to give each pair's wall-time ratio too (the time of its first k steps)")
@click.option("--arm", type=click.Choice(["without", "with"]), hidden=True)
@click.option("--out", hidden=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="write every run and the summary here")
def main(study: str, steps: int, pairs: int, overhead_rounds: int, at: str, arm: str | None, out: str | None,
         json_out: str | None) -> None:
    if arm is not None:  # one rank of one run
        run_studies(MODULE, [study], lambda _: [], lambda s: rank_main(s, arm, steps, overhead_rounds, out))
        return
    runs = []
    tmp = Path(tempfile.mkdtemp(prefix="payback-"))
    for i in range(2 * pairs):
        this = "without" if i % 2 == 0 else "with"
        path = tmp / f"run{i}.json"
        forward = [study, "--arm", this, "--steps", str(steps), "--overhead-rounds", str(overhead_rounds),
                   "--out", str(path)]
        run_studies(MODULE, [study], lambda _, f=forward: f, lambda s: None)
        runs.append(json.loads(path.read_text()))
        print(f"run {i} ({this}): {runs[-1]['wall_s']:.1f} s", flush=True)
    summary = report(runs, [int(k) for k in at.split(",") if k])
    if json_out:
        Path(json_out).write_text(json.dumps({"study": study, "steps": steps, "runs": runs, **summary}, indent=1))


if __name__ == "__main__":
    main()
