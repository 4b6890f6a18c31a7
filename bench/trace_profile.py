"""Benchmark: a profile built from a user's ``torch.profiler`` traces against the recorder's, same model and ranks.

    python -m bench.trace_profile [studies/llama-cpu.toml ...] [--steps 5] [--json out.json]
    python -m bench.trace_profile --refit run.json ...   # saved runs (both profiles), today's simulator, no ranks
    python -m bench.trace_profile --decompose DIR        # traces: per step, the step against the sum of its calls

For each study, on its ranks: the recorder's profile (``runtime.recording.recorder.record_profile``, what ``tune``
uses); then a
fresh model in a user's plain loop (``train_step``) under ``torch.profiler`` with the CPU activity (and CUDA's on
GPU), ``profile_memory=True`` and ``record_shapes=True``, ``--steps`` active steps in cycles of one untraced step,
one warm-up and ``--active`` active steps (torchtitan's default traces one step a cycle), each rank's trace of each
cycle written by ``tensorboard_trace_handler`` (into ``--traces DIR``, or a temporary folder); then the recorder
again on the traced model (unless ``--no-recorder-again``), as the comparison's floor: how far the recorder moves
from itself minutes later on this machine. Rank 0 then builds the
profile from the traces (:func:`planner.traces.trace_profile.profile_from_traces`, with the model's fingerprint, as
``--model`` gives) and prints, per module and figure, trace against recorder; on CPU, the reduce-scatter in the
recorder's kind too (the trace's bare call, :func:`bare_reduce_scatters`); the post-forward orders; the simulated
default step from the trace profile's module figures alone against the traced step; the peaks; and, per traced
step, the step against the sum of its calls' figures (:func:`decompose`).
Targets (issue 21): the same post-forward order; module compute and collective times within 10% median; the
simulated default step within 5% of the traced step.
"""

from __future__ import annotations

import gc
import json
import statistics
import tempfile
from pathlib import Path

import click

from bench.ranks import json_flag, report_saved, run_studies, saved_run_options, studies_argument, user_profiler

MODULE = "bench.trace_profile"
FIGURES = ("fwd_ms", "bwd_ms", "all_gather_ms", "reduce_scatter_ms")


def rank_main(study: str, steps: int, out: str | None, per_module: bool = False, traces: str | None = None,
              active: int = 1, recorder_again: bool = True) -> None:
    """Every rank: record, then trace a fresh model's plain loop, then (``recorder_again``) record the traced model;
    rank 0 builds, compares and reports."""
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
        recorded = record_profile(workload, warmup_steps=config.measure.warmup_steps, steps=config.measure.steps,
                                  repeats=config.measure.profile_repeats)
        # the same model again, its isolated passes one module at a time
        per_module_profile = None if not per_module else record_profile(
            workload, warmup_steps=1, steps=config.measure.steps, repeats=config.measure.profile_repeats,
            per_module=True)
        del workload
        gc.collect()  # FSDP2's states hold reference cycles: else the recorded model stays in the traced step's memory
        user = build_study_workload(config.workload, mesh)  # the user's job: a fresh model, the plain loop
        for s in range(2):
            train_step(user, s)
        folder = gather_objects((traces or tempfile.mkdtemp(prefix="traces-")) if dist.get_rank() == 0 else None)[0]
        # [Note: Several traces of one rank] in planner.traces.trace_profile: one file per rank and cycle (as a GPU user
        # traces: the kernels too, on their streams)
        cycles = -(-steps // active)
        schedule = torch.profiler.schedule(wait=1, warmup=1, active=active, repeat=cycles)
        with user_profiler(mesh.device_type, folder, schedule) as prof:
            for s in range(cycles * (2 + active)):
                train_step(user, 2 + s)
                prof.step()
        dist.barrier()
        # the recorder again, minutes later, on the traced model: how far the recorder moves from itself here
        again = record_profile(user, warmup_steps=config.measure.warmup_steps, steps=config.measure.steps,
                               repeats=config.measure.profile_repeats) if recorder_again else None
        if dist.get_rank() == 0:
            from planner.traces.trace_profile import profile_from_traces

            traced = profile_from_traces([folder], recorded.fingerprint)
            parsed = steps_and_calls([folder])  # the decomposition's and the bare reduce-scatters' view of the traces
            run = {"study": config.name, "steps": steps, "active": active, "traces": folder,
                   "recorded": recorded.to_dict(),
                   "traced": traced.profile.to_dict(), "ranks": list(traced.ranks), "traced_steps": traced.steps,
                   "missing": [m.line() for m in traced.missing], "rank_skew_ms": traced.rank_skew_ms,
                   "outside_ms": traced.outside_ms, "decomposition": decompose(parsed),
                   "recorded_per_module": per_module_profile.to_dict() if per_module_profile else None,
                   "recorded_again": again.to_dict() if again else None,
                   "bare_reduce_scatter_ms": bare_reduce_scatters(parsed[1]) if mesh.device_type == "cpu" else None}
            report(run)
            if out:
                Path(out).write_text(json.dumps(run))
        del user
        rank.ended = True


def _error(a: float, b: float) -> float:
    """``a`` against ``b``, percent (0 where ``b`` is 0)."""
    return 100 * (a - b) / b if b else 0.0


def report(run: dict) -> dict:
    """Print the comparison of the run's two profiles; returns the summary."""
    import dataclasses

    from planner.artifacts.plan import Plan
    from planner.artifacts.profile import Profile
    from planner.simulation.parameters import simulate
    from planner.units import mib

    recorded, t = Profile.from_dict(run["recorded"]), Profile.from_dict(run["traced"])
    print(f"\n== {run['study']}: profile from {len(run['ranks'])} traces ({run['traced_steps']} steps each; "
          f"{run['traces']}) vs the recorder")
    print(f"post-forward order: {'same' if t.post_forward_order == recorded.post_forward_order else 'DIFFERENT'} "
          f"({len(t.post_forward_order)} entries)")
    # at world size 1 FSDP2 runs no collective (FSDPParamGroup.unshard returns before its all-gather): no figure
    figures = FIGURES if recorded.fingerprint.world_size > 1 else FIGURES[:2]
    if len(figures) < len(FIGURES):
        print("world size 1: FSDP2 runs no all-gather or reduce-scatter, so the trace has none to compare")
    print(f"{'module':<18}" + "".join(f"{f:>26}" for f in figures))
    for fqn in recorded.fingerprint.module_fqns:
        cells = []
        for f in figures:
            a, b = getattr(t.modules[fqn], f), getattr(recorded.modules[fqn], f)
            cells.append(f"{a:8.2f} / {b:8.2f} {_error(a, b):+6.0f}%")
        print(f"{fqn or '(root)':<18}" + "".join(f"{c:>26}" for c in cells))
    medians = _median_errors(t, recorded, figures)
    print("median |error| (trace vs recorder): " + ", ".join(f"{f} {v:.1f}%" for f, v in medians.items())
          + " (target <= 10%)")
    print("  with each figure's level removed (its median ratio over modules, the level a step-wide scale absorbs): "
          + _shapes(t, recorded, figures))
    if recorded.fingerprint.device_type == "cpu":
        print("  (CPU: the trace's reduce-scatter is foreach_reduce's whole work on the thread, copies included; the "
              "recorder's is a bare reduce-scatter of preallocated buffers)")
        if run.get("bare_reduce_scatter_ms") and "reduce_scatter_ms" in figures:  # older saved runs lack it
            print(bare_reduce_scatter_line(t, recorded, run["bare_reduce_scatter_ms"])[0])
    outside, skew = run.get("outside_ms"), run.get("rank_skew_ms")
    if outside and not t.outside_ms:  # a run saved before the profile carried it: as today's code builds it
        t = dataclasses.replace(t, outside_ms=outside)
    alone = dataclasses.replace(t, in_step=None)
    predicted = simulate(alone, Plan.default(alone)).step_ms
    recorder_alone = dataclasses.replace(recorded, in_step=None)
    recorder_predicted = simulate(recorder_alone, Plan.default(recorder_alone)).step_ms
    step_err = 100 * (predicted / t.measured_step_ms - 1)
    print(f"default step: traced {t.measured_step_ms:.1f} ms (under the profiler), recorder's untraced "
          f"{recorded.measured_step_ms:.1f} ms; simulated from the profile's figures alone: trace profile "
          f"{predicted:.1f} ms ({step_err:+.1f}% vs traced, target 5%), recorder's profile {recorder_predicted:.1f} ms "
          f"({100 * (recorder_predicted / recorded.measured_step_ms - 1):+.1f}% vs its step)")
    if t.outside_ms:  # measured in the same steps, not fitted: the loss, zero_grad, hooks, the loop
        modules_only = predicted - t.outside_ms
        print(f"  of which the traced work outside the modules {t.outside_ms:.1f} ms; without it "
              f"{modules_only:.1f} ms ({100 * (modules_only / t.measured_step_ms - 1):+.1f}% vs traced)")
    if skew:
        print(f"  rank skew: a rank waited up to {skew:.1f} ms a step for a late rank (in the figures: the late "
              "rank's work, each call's most of the ranks)")
    for line in run.get("decomposition") or []:
        print(f"  {line}")
    if t.measured_peak_bytes and recorded.measured_peak_bytes:
        print(f"peak: trace profile {mib(t.measured_peak_bytes)} (start bytes estimated), recorder "
              f"{mib(recorded.measured_peak_bytes)} "
              f"({100 * (t.measured_peak_bytes / recorded.measured_peak_bytes - 1):+.1f}%)")
    print("backward temporaries, trace / recorder: the root " + " / ".join(
              mib(p.modules[p.root_fqn].backward_temp_bytes) for p in (t, recorded))
          + ", the modules' median " + " / ".join(
              mib(int(statistics.median([m.backward_temp_bytes for f, m in p.modules.items() if f != p.root_fqn]
                                        or [0]))) for p in (t, recorded)))
    print("the root's saved bytes, trace / recorder: " + " / ".join(
        mib(p.modules[p.root_fqn].activation_bytes) for p in (t, recorded)) + ", of them after its blocks' forward "
          "(freed before their backward) " + " / ".join(
        mib(p.modules[p.root_fqn].activation_post_bytes) for p in (t, recorded)))
    if recorded.measured_peak_bytes:
        peaks = [simulate(p, Plan.default(p)).peak_bytes for p in (alone, recorder_alone)]
        print(f"  the default's simulated peak from the trace profile {mib(peaks[0])}, from the recorder's "
              f"{mib(peaks[1])}; the recorder measured {mib(recorded.measured_peak_bytes)} "
              f"({100 * (peaks[1] / recorded.measured_peak_bytes - 1):+.1f}%)")
    for line in run["missing"]:
        print(f"  estimated: {line}")
    if run.get("recorded_per_module"):
        other = Profile.from_dict(run["recorded_per_module"])
        print("against the recorder with one module per isolated pass (--per-module): median |error| "
              + _medians(t, other, figures))
    summary = {"median_abs_error_pct": medians, "step_error_pct": step_err, "rank_skew_ms": skew,
               "same_order": t.post_forward_order == recorded.post_forward_order}
    if run.get("recorded_again"):  # the noise floor of the comparison: the recorder against itself, minutes apart
        again = Profile.from_dict(run["recorded_again"])
        print(f"the recorder again after the trace (its step {again.measured_step_ms:.1f} ms): against its first "
              f"recording, median |error| {_medians(again, recorded, figures)}; the trace against it "
              f"{_medians(t, again, figures)}")
        print(f"  with the level removed: against its first {_shapes(again, recorded, figures)}; the trace against it "
              f"{_shapes(t, again, figures)}")
        summary["recorder_again_median_abs_error_pct"] = _median_errors(again, recorded, figures)
    return summary


def _median_errors(a, b, figures: tuple[str, ...]) -> dict[str, float]:
    """``a``'s module figures against ``b``'s: per figure the median over ``b``'s modules of the |error|, %."""
    return {f: statistics.median(abs(_error(getattr(a.modules[q], f), getattr(b.modules[q], f)))
                                 for q in b.fingerprint.module_fqns) for f in figures}


def _shape_errors(a, b, figures: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """``a``'s module figures against ``b``'s with the level removed: per figure ``(level, error)``, the level the
    median over ``b``'s modules of ``a / b`` (modules where ``b`` is 0 left out) and the error the median of
    ``|(a / b) / level - 1|``, %. A one-number scale over every module (the in-step ``comm_scale``) corrects the
    level, not the error."""
    shapes = {}
    for f in figures:
        ratios = [getattr(a.modules[q], f) / getattr(b.modules[q], f) for q in b.fingerprint.module_fqns
                  if getattr(b.modules[q], f)] or [1.0]
        level = statistics.median(ratios)
        shapes[f] = (level, 100 * statistics.median(abs(r / level - 1) for r in ratios))
    return shapes


def _shapes(a, b, figures: tuple[str, ...]) -> str:
    """:func:`_shape_errors`, printed."""
    return ", ".join(f"{f} x{level:.2f} {error:.1f}%" for f, (level, error) in _shape_errors(a, b, figures).items())


def _medians(a, b, figures: tuple[str, ...]) -> str:
    """:func:`_median_errors`, printed."""
    return ", ".join(f"{f} {v:.1f}%" for f, v in _median_errors(a, b, figures).items())


def bare_reduce_scatters(per_step: list) -> dict[str, float]:
    """Per module, the mean over its reduce-scatter calls in ``per_step`` (:func:`steps_and_calls`' second part) of
    the bare call's time, ms: gloo's input copy and the transfer, from the last rank's start, the most of the ranks
    (``planner.traces.trace_profile._collective_ms(bare=True)``), what the recorder's bare reduce-scatter times."""
    from collections import defaultdict

    from planner.traces.trace_profile import _collective_ms

    out = defaultdict(list)
    for _, calls in per_step:
        for (module, kind, _), cs in calls.items():
            if kind == "reduce_scatter":
                out[module].append(_collective_ms(cs, bare=True))
    return {module: statistics.fmean(v) for module, v in out.items()}


def bare_reduce_scatter_line(traced, recorded, bare: dict[str, float]) -> tuple[str, float]:
    """The report's line on the reduce-scatter in the recorder's kind: ``bare`` (:func:`bare_reduce_scatters`)
    against the recorder's figures (median |error| over modules, and the level, the median ratio), and FSDP2's
    copies around the call (the trace profile's figure less the bare one). Returns the line and the median |error|,
    percent."""
    fqns = [q for q in recorded.fingerprint.module_fqns if q in bare]
    errors = [abs(_error(bare[q], recorded.modules[q].reduce_scatter_ms)) for q in fqns]
    level = statistics.median(bare[q] / recorded.modules[q].reduce_scatter_ms for q in fqns)
    copies = statistics.median(traced.modules[q].reduce_scatter_ms - bare[q] for q in fqns)
    return (f"  the reduce-scatter in the recorder's kind (the trace's bare call: gloo's input copy and the transfer, "
            f"no foreach_reduce copies): median |error| {statistics.median(errors):.1f}%, level x{level:.2f}; "
            f"FSDP2's copies around it {copies:.1f} ms a module (median)"), statistics.median(errors)


def steps_and_calls(folders: list[str]) -> tuple[str, list[tuple[tuple, dict[tuple[str, str, int], list]]]]:
    """The traces in ``folders``, step by step: their device type, and per step the ranks' ``RankStep``s and every
    collective call's ranks' views, ``{(module, kind, ordinal): [Collective, ...]}``."""
    from collections import defaultdict

    from planner.traces.kineto import read_trace, trace_files
    from planner.traces.trace_profile import _by_rank, _steps_of_rank

    traces = _by_rank([read_trace(p) for p in trace_files(folders)])
    per_rank = [_steps_of_rank(rank, files) for rank, files in traces.items()]
    out = []
    for steps in zip(*per_rank, strict=False):
        calls = defaultdict(list)
        for s in steps:
            for c in s.collectives:
                calls[(c.module, c.kind, c.ordinal)].append(c)
        out.append((steps, calls))
    return next(iter(traces.values()))[0].device_type, out


def decompose(parsed: tuple[str, list]) -> list[str]:
    """Per traced step (CPU), the step (the most of the ranks) against the sum of its calls' figures: each module's
    forward and backward compute, the most of the ranks in that step; each collective as the profile times it
    (:func:`planner.traces.trace_profile._collective_ms`); the optimizer; then the collectives' medians and means
    over calls, summed per step, against the steps. ``parsed``: :func:`steps_and_calls` of the traces. Lines to
    print; ``[]`` for GPU traces (stretches overlap)."""
    from collections import defaultdict

    from planner.traces.trace_profile import _collective_ms

    device_type, per_step = parsed
    if device_type != "cpu":
        return []
    lines, by_call, colls = [], defaultdict(list), []
    for steps, calls in per_step:
        compute = sum(max(s.fwd_ms.get(m, 0.0) for s in steps) + max(s.bwd_ms.get(m, 0.0) for s in steps)
                      for m in steps[0].fwd_ms)
        coll = 0.0
        for (module, kind, _), cs in calls.items():
            ms = _collective_ms(cs)
            coll += ms
            by_call[(module, kind)].append(ms)
        colls.append(coll)
        opt = max(s.optimizer_ms or 0.0 for s in steps)
        step = max(s.step_ms for s in steps)
        total = compute + coll + opt
        lines.append(f"step {steps[0].number}: {step:.0f} ms; its calls' figures sum to {total:.0f} "
                     f"({100 * (total / step - 1):+.1f}%: compute {compute:.0f}, collectives {coll:.0f}, optimizer "
                     f"{opt:.0f})")
    n = len(colls)
    medians = sum(statistics.median(v) * len(v) / n for v in by_call.values())
    means = sum(statistics.fmean(v) * len(v) / n for v in by_call.values())
    lines.append(f"collectives a step: the sum of each call's median {medians:.0f} ms, of its mean {means:.0f}; the "
                 f"steps held {min(colls):.0f}-{max(colls):.0f} (median {statistics.median(colls):.0f})")
    return lines


@click.command(help=__doc__)
@studies_argument
@saved_run_options
@click.option("--steps", default=5, show_default=True, help="active steps traced")
@click.option("--active", default=1, show_default=True,
              help="active steps per profiler cycle (each cycle: one untraced step, one warm-up, then these)")
@click.option("--per-module", is_flag=True, help="also record with one module per isolated pass, and compare")
@click.option("--no-recorder-again", "recorder_again", is_flag=True, flag_value=False, default=True,
              help="skip the second recording after the trace (the recorder against itself, the comparison's floor)")
@click.option("--traces", type=click.Path(file_okay=False), help="write the traces here (default: a temporary folder)")
@click.option("--decompose", "decompose_dir", type=click.Path(exists=True, file_okay=False),
              help="print, per step of the traces there, the step against the sum of its calls, and stop")
def main(studies: tuple[str, ...], json_out: str | None, refit: tuple[str, ...], steps: int, active: int,
         per_module: bool, recorder_again: bool, traces: str | None, decompose_dir: str | None) -> None:
    if decompose_dir:
        print("\n".join(decompose(steps_and_calls([decompose_dir]))))
        return
    if report_saved(refit, report):
        return
    run_studies(MODULE, studies,
                lambda study: [study, "--steps", str(steps), "--active", str(active), *json_flag(json_out),
                               *(["--per-module"] * per_module), *(["--no-recorder-again"] * (not recorder_again)),
                               *(["--traces", traces] if traces else [])],
                lambda study: rank_main(study, steps, json_out, per_module, traces, active, recorder_again))


if __name__ == "__main__":
    main()
