"""Benchmark: the tune job's recorder against the in-loop tuner's, same model, same ranks, fresh processes.

    python -m bench.recorders [studies/llama-cpu.toml bench/plain-loop-cpu.toml] [--launches 2] [--json out.json]
    python -m bench.recorders --refit out.json        # a saved run reported again, no ranks

The one recorder (``runtime.recording.recorder.Recorder``) builds a :class:`planner.Profile` on two schedules:
``record_profile`` (what ``tune`` and ``profile`` run, on a workload factory's steps and loss) and the in-loop
tuner's (what ``AutoTuner`` runs, on the user's own steps inside ``with tuner.step()``, with a surrogate loss). They
share the step runner, the step figures, the isolated passes and the consolidation; they differ in when FSDP2's
default steps are timed and in the loss the isolated backward runs. This bench shows whether they give the same
profile.

Each launch is a fresh ``torchrun`` process that records one profile with one recorder, ``[measure] steps`` timed
steps of FSDP2's default (the study's warm-up steps and profile repeats too); the launches alternate between the
recorders, the order rotated (tune, loop, loop, tune, ...), ``--launches`` of each. The in-loop recording runs the
study's workload as a user's loop (``with tuner.step(): train_step(...)``) until the tuner leaves its recording
phase; its profile is the one the tuner hands its search.

The report, per study: the byte and order fields (activation, recompute, backward-temporary, unsharded and sharded
bytes, calls, whether backward needs the parameters, the pre- and post-forward orders), which must be equal; and
per time figure (each module's forward, backward, all-gather and reduce-scatter ms, the step and the optimizer ms,
the peak), the two recorders' means against the spread of each recorder between its own launches.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import click

from bench.ranks import as_tune_ranks, report_saved, saved_run_options, studies_argument

MODULE = "bench.recorders"
STUDIES = ("studies/llama-cpu.toml", "bench/plain-loop-cpu.toml")
TIMES = ("fwd_ms", "bwd_ms", "all_gather_ms", "reduce_scatter_ms")
BYTES = ("activation_bytes", "recompute_activation_bytes", "backward_temp_bytes", "backward_post_grad_bytes",
         "activation_post_bytes", "unsharded_bytes", "sharded_bytes", "grad_bytes", "calls",
         "needs_parameters_in_backward")
RECORDERS = ("tune", "loop")
PLAIN_LOOP = Path(__file__).resolve().parents[1] / "docs" / "examples" / "plain_loop.py"


def plain_loop(mesh: Any, vocab: int = 128, dim: int = 64, layers: int = 3, batch_size: int = 4, seq_len: int = 16,
               lr: float = 1e-3) -> Any:
    """``docs/examples/plain_loop.py``'s model, optimizer, batches and loss as a workload factory: its
    ``Classifier`` (imported from the example's file), ``fully_shard`` on each block then the root, AdamW, token
    batches drawn per step and rank, next-token cross-entropy."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from runtime.workload import Workload

    spec = importlib.util.spec_from_file_location("plain_loop_example", PLAIN_LOOP)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    model = example.Classifier(vocab=vocab, dim=dim, layers=layers)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    rank = dist.get_rank()

    def make_batch(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(10_000 * step + rank)
        return torch.randint(0, vocab, (batch_size, seq_len), generator=g)

    def loss_fn(m: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        logits = m(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    return Workload(model, torch.optim.AdamW(model.parameters(), lr=lr), make_batch, loss_fn)


def rank_main(study: str, recorder: str, out: str) -> None:
    """Every rank: record one profile of ``study``'s workload with ``recorder`` (``tune`` or ``loop``); rank 0
    writes it to ``out``."""
    import torch.distributed as dist

    from planner.artifacts.config import load_study_config
    from runtime.ranks.rank import job_rank
    from runtime.workload import build_study_workload

    as_tune_ranks()
    config = load_study_config(study)
    with job_rank(config.launch) as rank:
        mesh = rank.mesh
        workload = build_study_workload(config.workload, mesh)
        measure = config.measure
        if recorder == "tune":
            from runtime.recording.recorder import record_profile

            profile = record_profile(workload, warmup_steps=measure.warmup_steps, steps=measure.steps,
                                     repeats=measure.profile_repeats)
        else:
            profile = _in_loop_profile(workload, measure)
        if dist.get_rank() == 0:
            Path(out).write_text(json.dumps(profile.to_dict()))
        rank.ended = True


def _in_loop_profile(workload: Any, measure: Any) -> Any:
    """The profile ``AutoTuner`` records on a user's loop of ``workload`` and hands its search (rank 0's)."""
    from runtime.in_loop.autotuner import AutoTuner
    from runtime.workload import train_step

    folder = tempfile.mkdtemp(prefix="recorders-")
    tuner = AutoTuner(workload.model, study="recorders", storage=f"sqlite:///{folder}/recorders.db",
                      warmup_steps=measure.warmup_steps, steps=measure.steps, profile_repeats=measure.profile_repeats,
                      sim_trials=10, measured_trials=1)
    recorded: list[Any] = []
    search = tuner._round.search  # the one call that receives the recorded profile ([Note: Tuning on the user's steps])

    def keep(profile: Any, recheck: bool = False) -> Any:
        recorded.append(profile)
        return search(profile, recheck)

    tuner._round.search = keep
    step = 0
    while not recorded:  # every rank leaves on the same step: the recording ends in a collective decision
        with tuner.step():
            train_step(workload, step)
        step += 1
    tuner.close()
    return recorded[0]


def _mean_spread(values: list[float]) -> tuple[float, float]:
    """The mean, and the spread between launches as a percent of it (max less min)."""
    mean = statistics.fmean(values)
    return mean, (100 * (max(values) - min(values)) / mean if mean else 0.0)


def report(run: dict) -> dict:
    """Print the comparison of one study's launches (``run``: ``{"study", "profiles": {"tune": [...], "loop":
    [...]}}``); returns the summary: the differing byte and order fields and, per time figure, the gap between the
    recorders and the larger of their own spreads (percent)."""
    from planner.artifacts.profile import Profile
    from planner.units import mib

    profiles = {r: [Profile.from_dict(d) for d in run["profiles"][r]] for r in RECORDERS}
    first = {r: profiles[r][0] for r in RECORDERS}
    fqns = first["tune"].fingerprint.module_fqns
    print(f"\n== {run['study']}: {len(profiles['tune'])} + {len(profiles['loop'])} launches, tune's recorder vs the "
          "in-loop recorder")
    differing = []
    for name in ("pre_forward_order", "post_forward_order", "microbatches", "optimizer_state_bytes"):
        values = {r: [getattr(p, name) for p in profiles[r]] for r in RECORDERS}
        same = all(v == values["tune"][0] for vs in values.values() for v in vs)
        if not same:
            differing.append(name)
        print(f"{name}: {'equal' if same else 'DIFFERENT ' + str(values)}")
    for name in BYTES:
        values = {r: [[getattr(p.modules[q], name) for q in fqns] for p in profiles[r]] for r in RECORDERS}
        same = all(v == values["tune"][0] for vs in values.values() for v in vs)
        if not same:
            differing.append(name)
        print(f"{name}: {'equal on every module' if same else 'DIFFERENT'}")
        if not same:
            for i, q in enumerate(fqns):
                tune, loop = ([v[i] for v in values[r]] for r in RECORDERS)
                print(f"  {q or '(root)':<18} tune {tune}  loop {loop}")
    print(f"{'figure':<34}{'tune (mean, spread)':>24}{'loop (mean, spread)':>24}{'loop vs tune':>14}")
    rows = []

    def row(label: str, per_recorder: dict[str, list[float | None]], unit: str = "ms") -> None:
        if any(v is None for vs in per_recorder.values() for v in vs):  # not measured (a synthetic profile)
            return
        (t, ts), (lo, ls) = (_mean_spread(per_recorder[r]) for r in RECORDERS)
        gap = 100 * (lo / t - 1) if t else 0.0
        within = abs(gap) <= max(ts, ls)
        rows.append({"figure": label, "tune": t, "tune_spread_pct": ts, "loop": lo, "loop_spread_pct": ls,
                     "gap_pct": gap, "within_spread": within})
        fmt = (lambda v: mib(int(v))) if unit == "bytes" else (lambda v: f"{v:.2f}")
        print(f"{label:<34}{fmt(t) + f' {ts:5.1f}%':>24}{fmt(lo) + f' {ls:5.1f}%':>24}{gap:+12.1f}%"
              + ("" if within else "  outside"))

    for q in fqns:
        for f in TIMES:
            row(f"{q or '(root)'} {f}", {r: [getattr(p.modules[q], f) for p in profiles[r]] for r in RECORDERS})
    row("step ms", {r: [p.measured_step_ms for p in profiles[r]] for r in RECORDERS})
    row("optimizer ms", {r: [p.optimizer_ms for p in profiles[r]] for r in RECORDERS})
    row("peak", {r: [p.measured_peak_bytes for p in profiles[r]] for r in RECORDERS}, unit="bytes")
    row("optimizer temporaries", {r: [p.optimizer_temp_bytes for p in profiles[r]] for r in RECORDERS},
        unit="bytes")
    outside = [r["figure"] for r in rows if not r["within_spread"]]
    print(f"byte and order fields differing: {differing or 'none'}; time figures outside the larger spread of "
          f"the two recorders: {len(outside)} of {len(rows)}" + (f" ({', '.join(outside)})" if outside else ""))
    in_step = {r: [p.in_step is not None and p.in_step.async_default_step_ms is not None for p in profiles[r]]
               for r in RECORDERS}
    print(f"the async default's step (the overlap slowdown's source on CPU): tune {in_step['tune']}, "
          f"loop {in_step['loop']}")
    return {"study": run["study"], "differing": differing, "rows": rows}


@click.command(help=__doc__)
@studies_argument
@saved_run_options
@click.option("--launches", default=2, show_default=True, help="fresh launches of each recorder, alternated")
@click.option("--rank-recorder", type=click.Choice(RECORDERS), hidden=True)
@click.option("--rank-out", hidden=True)
def main(studies: tuple[str, ...], json_out: str | None, refit: tuple[str, ...], launches: int,
         rank_recorder: str | None, rank_out: str | None) -> None:
    import sys

    from planner.artifacts.config import load_study_config
    from planner.errors import PlannerError
    from runtime.ranks.launch import in_torchrun, launch_ranks

    if rank_recorder:
        if not in_torchrun():
            raise click.UsageError("--rank-recorder is for the ranks this bench starts")
        rank_main(studies[0], rank_recorder, rank_out)
        return
    if report_saved(refit, lambda saved: [report(r) for r in saved["runs"]]):
        return
    runs = []
    folder = Path(tempfile.mkdtemp(prefix="recorders-"))
    try:
        for study in studies or STUDIES:
            launch = load_study_config(study).launch
            profiles: dict[str, list[dict]] = {r: [] for r in RECORDERS}
            for i in range(launches):
                for recorder in RECORDERS if i % 2 == 0 else RECORDERS[::-1]:
                    out = folder / f"{Path(study).stem}-{recorder}-{i}.json"
                    code = launch_ranks([study, "--rank-recorder", recorder, "--rank-out", str(out)], launch,
                                        module=MODULE)
                    if code:
                        sys.exit(code)
                    profiles[recorder].append(json.loads(out.read_text()))
            run = {"study": study, "profiles": profiles}
            report(run)
            runs.append(run)
    except PlannerError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if json_out:
        Path(json_out).write_text(json.dumps({"runs": runs}))


if __name__ == "__main__":
    main()
