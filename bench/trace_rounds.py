"""Benchmark: the trace profile against the recorder, the two recorded in turn on one model, in rounds.

    python -m bench.trace_rounds [studies/llama-cpu.toml ...] [--rounds 4] [--steps 4] [--json out.json]
    python -m bench.trace_rounds --refit run.json ...   # saved runs, today's simulator, no ranks

``bench.trace_profile`` records once and traces once, minutes apart, and on a CPU the level of the collectives
moves between two recordings of one process by as much as the agreement sought (docs/decisions/cpu-step-level.md).
So this bench compares them as two plans are compared: interleaved, the order rotated. Every
rank builds one model, runs two plain steps, then ``--rounds`` rounds; a round records the profile
(``runtime.recording.recorder.record_profile``, what ``tune`` uses) and traces ``--steps`` active steps of the plain
loop under
``torch.profiler`` (as ``bench.trace_profile`` does: CPU activity, memory, shapes; cycles of one untraced step, one
warm-up and ``--active`` traced), the recorder first in even rounds and the trace first in odd ones. Rank 0 builds a
trace profile per round and one from every round's traces, and prints:

- the pooled comparison: the trace profile of every round against the median over rounds of the recorder's
  figures, per module, median |error| (issue 21's target: 10%);
- the reduce-scatter in the recorder's kind: the recorder times a bare reduce-scatter of preallocated buffers, the
  trace FSDP2's ``foreach_reduce`` with its ``chunk_cat`` copy-in and the copy into the sharded gradient; the
  trace's bare call (gloo's input copy and the transfer, ``_collective_ms(bare=True)``) against the recorder's;
- per round, the trace against that round's recording, and each level (the median over modules of trace over
  recorder): paired, so the machine's drift between rounds drops out;
- the floors: each source against itself in the next round;
- the simulated default step from the pooled trace profile against the traced steps (target: 5%).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

import click

from bench.ranks import json_flag, report_saved, run_studies, saved_run_options, studies_argument, user_profiler
from bench.trace_profile import (
    FIGURES,
    _error,
    _median_errors,
    _shape_errors,
    bare_reduce_scatter_line,
    bare_reduce_scatters,
    steps_and_calls,
)

MODULE = "bench.trace_rounds"


def rank_main(study: str, rounds: int, steps: int, active: int, out: str | None, traces: str | None) -> None:
    """Every rank: one model, ``rounds`` rounds of a recording and a traced plain loop in turn; rank 0 builds the
    trace profiles and reports (:func:`report`)."""
    import torch
    import torch.distributed as dist

    from planner.artifacts.config import load_study_config
    from runtime.ranks.collectives import gather_objects
    from runtime.ranks.rank import job_rank
    from runtime.recording.recorder import record_profile
    from runtime.workload import build_study_workload, train_step

    config = load_study_config(study)
    with job_rank(config.launch) as rank:
        mesh = rank.mesh
        workload = build_study_workload(config.workload, mesh)
        for s in range(2):
            train_step(workload, s)
        mine = (traces or tempfile.mkdtemp(prefix="trace-rounds-")) if dist.get_rank() == 0 else None
        folder = gather_objects(mine)[0]
        cycles = -(-steps // active)
        schedule = torch.profiler.schedule(wait=1, warmup=1, active=active, repeat=cycles)
        recorded, step = [], 2
        for r in range(rounds):
            for part in ("record", "trace") if r % 2 == 0 else ("trace", "record"):
                if part == "record":
                    recorded.append(record_profile(workload, warmup_steps=config.measure.warmup_steps,
                                                   steps=config.measure.steps, repeats=config.measure.profile_repeats))
                    continue
                # ProfilerStep#N counts from the profiler's step_num: the rounds' steps numbered apart, as one job's
                offset = r * cycles * (2 + active)
                profiler = user_profiler(mesh.device_type, f"{folder}/round{r}",
                                         lambda n, offset=offset: schedule(max(0, n - offset)))
                profiler.step_num = offset
                with profiler as prof:
                    for _ in range(cycles * (2 + active)):
                        train_step(workload, step)
                        step += 1
                        prof.step()
                dist.barrier()
        if dist.get_rank() == 0:
            from planner.traces.trace_profile import profile_from_traces

            subs = [f"{folder}/round{r}" for r in range(rounds)]
            fingerprint = recorded[0].fingerprint
            pooled = profile_from_traces(subs, fingerprint)
            per_round = [steps_and_calls([s])[1] for s in subs]  # each round's steps and calls, parsed once
            run = {"study": config.name, "rounds": rounds, "steps": steps, "active": active, "traces": folder,
                   "recorded_rounds": [p.to_dict() for p in recorded],
                   "traced_rounds": [profile_from_traces([s], fingerprint).profile.to_dict() for s in subs],
                   "traced": pooled.profile.to_dict(), "missing": [m.line() for m in pooled.missing],
                   "bare_reduce_scatter_ms": bare_reduce_scatters([step for r in per_round for step in r]),
                   "bare_reduce_scatter_rounds_ms": [bare_reduce_scatters(r) for r in per_round]}
            report(run)
            if out:
                Path(out).write_text(json.dumps(run))
        del workload
        rank.ended = True


def median_profile(profiles: list):
    """The first of ``profiles`` (one model's) with each module's figures of :data:`FIGURES` and the measured step
    replaced by their medians over ``profiles``."""
    first = profiles[0]
    modules = {fqn: dataclasses.replace(m, **{f: statistics.median(getattr(p.modules[fqn], f) for p in profiles)
                                              for f in (*FIGURES, "recompute_ms")})
               for fqn, m in first.modules.items()}
    return dataclasses.replace(first, modules=modules,
                               measured_step_ms=statistics.median(p.measured_step_ms for p in profiles))


def levels(a, b, figures: tuple[str, ...]) -> dict[str, float]:
    """Per figure, the median over ``b``'s modules of ``a``'s figure over ``b``'s (modules where ``b`` is 0 left
    out): the level a step-wide scale absorbs."""
    return {f: level for f, (level, _) in _shape_errors(a, b, figures).items()}


def recompute_line(traced, recorded) -> tuple[str, float] | None:
    """The checkpointed modules' recompute (the part of ``bwd_ms`` that re-runs the forward), ``traced`` against
    ``recorded``: the line and the median |error| over the modules the recorder saw recompute, %; ``None`` where it
    saw none (no checkpointing)."""
    fqns = [q for q in recorded.fingerprint.module_fqns if recorded.modules[q].recompute_ms > 0]
    if not fqns:
        return None
    error = statistics.median(abs(_error(traced.modules[q].recompute_ms, recorded.modules[q].recompute_ms))
                              for q in fqns)
    others = [q for q in recorded.fingerprint.module_fqns if q not in fqns and traced.modules[q].recompute_ms > 0]
    traced_ms, recorded_ms = (sum(p.modules[q].recompute_ms for q in fqns) for p in (traced, recorded))
    return (f"recompute, the {len(fqns)} modules the recorder saw recompute: median |error| {error:.1f}%, "
            f"{traced_ms:.1f} ms a step traced against {recorded_ms:.1f} recorded (the trace's span starts at a "
            f"block's first forward-only op, planner/traces/recompute.py); traced in {len(others)} other "
            "module(s)"), error


def report(run: dict) -> dict:
    """Print the comparison of a rounds run (module docstring); returns the summary."""
    from planner.artifacts.plan import Plan
    from planner.artifacts.profile import Profile
    from planner.simulation.parameters import simulate

    recorded = [Profile.from_dict(d) for d in run["recorded_rounds"]]
    traced = [Profile.from_dict(d) for d in run["traced_rounds"]]
    pooled, rec = Profile.from_dict(run["traced"]), median_profile(recorded)
    figures = FIGURES if rec.fingerprint.world_size > 1 else FIGURES[:2]
    n = len(recorded)
    print(f"\n== {run['study']}: {n} rounds, each the recorder and {run['steps']} traced steps in turn, one model "
          f"({run['traces']})")
    orders = {p.post_forward_order for p in recorded + traced + [pooled]}
    print(f"post-forward order: {'the same in every round and source' if len(orders) == 1 else 'DIFFERENT'}")
    medians = _median_errors(pooled, rec, figures)
    print("pooled (the trace profile of every round against the recorder's median over rounds), median |error|: "
          + ", ".join(f"{f} {v:.1f}%" for f, v in medians.items()) + " (target <= 10%)")
    summary = {"median_abs_error_pct": medians, "rounds": n}
    bare = run.get("bare_reduce_scatter_ms") or {}
    if "reduce_scatter_ms" in figures and bare:
        line, summary["bare_reduce_scatter_pct"] = bare_reduce_scatter_line(pooled, rec, bare)
        print(line)
    recompute = recompute_line(pooled, rec)
    if recompute is not None:
        print(recompute[0])
        summary["recompute_pct"] = recompute[1]
    print("per round, the trace against that round's recording: median |error| / level (trace over recorder)")
    print(f"{'round':<7}{'first':<9}" + "".join(f"{f:>24}" for f in figures))
    per_round = []
    for r, (t, p) in enumerate(zip(traced, recorded, strict=True)):
        errs, lv = _median_errors(t, p, figures), levels(t, p, figures)
        per_round.append({"errors": errs, "levels": lv})
        print(f"{r:<7}{'recorder' if r % 2 == 0 else 'trace':<9}"
              + "".join(f"{f'{errs[f]:.1f}% / x{lv[f]:.2f}':>24}" for f in figures))
    summary["per_round"] = per_round
    if n > 1:
        for name, profiles in (("the recorder", recorded), ("the trace", traced)):
            pairs = [_median_errors(b, a, figures) for a, b in zip(profiles, profiles[1:], strict=False)]
            print(f"floor, {name} against itself the next round, median |error|: " + ", ".join(
                f"{f} {min(p[f] for p in pairs):.1f}-{max(p[f] for p in pairs):.1f}%" for f in figures))
            summary[f"floor {name}"] = {f: statistics.median(p[f] for p in pairs) for f in figures}
    alone = dataclasses.replace(pooled, in_step=None)
    predicted = simulate(alone, Plan.default(alone)).step_ms
    step_err = 100 * (predicted / pooled.measured_step_ms - 1)
    summary["step_error_pct"] = step_err
    print(f"default step: traced {pooled.measured_step_ms:.1f} ms (rounds "
          + ", ".join(f"{t.measured_step_ms:.0f}" for t in traced) + "), the recorder's untraced "
          + ", ".join(f"{p.measured_step_ms:.0f}" for p in recorded) + f"; simulated from the pooled trace profile "
          f"alone {predicted:.1f} ms ({step_err:+.1f}% vs traced, target 5%)")
    for line in run.get("missing") or []:
        print(f"  estimated: {line}")
    return summary


@click.command(help=__doc__)
@studies_argument
@saved_run_options
@click.option("--rounds", default=4, show_default=True, help="rounds of a recording and a traced loop in turn")
@click.option("--steps", default=4, show_default=True, help="active steps traced a round")
@click.option("--active", default=1, show_default=True,
              help="active steps per profiler cycle (each cycle: one untraced step, one warm-up, then these)")
@click.option("--traces", type=click.Path(file_okay=False),
              help="write the traces here, one folder a round (default: a temporary folder)")
def main(studies: tuple[str, ...], json_out: str | None, refit: tuple[str, ...], rounds: int, steps: int,
         active: int, traces: str | None) -> None:
    if report_saved(refit, report):
        return
    run_studies(MODULE, studies,
                lambda study: [study, "--rounds", str(rounds), "--steps", str(steps), "--active", str(active),
                               *json_flag(json_out), *(["--traces", traces] if traces else [])],
                lambda study: rank_main(study, rounds, steps, active, json_out, traces))


if __name__ == "__main__":
    main()
