"""Launching ranks and what each rank runs.

``prefetch-planner tune STUDY.toml`` outside torchrun starts
``nproc_per_node`` ranks through ``torch.distributed.run`` running the same
command; under torchrun (``RANK`` and ``WORLD_SIZE`` set) the command runs as
that rank. Either way every rank ends up in :func:`tune_rank`.

The measured stage follows the rank protocol documented in
``runtime.protocol`` (rank 0 alone talks to the study; bounded timeouts; a
rank that raises fails the trial on every rank).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import socket
import sys
import uuid
from typing import Any

from planner.config import StudyConfig


def in_torchrun() -> bool:
    """Whether this process is a rank started by torchrun (``RANK``/``WORLD_SIZE`` set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch_ranks(cli_args: list[str], nproc_per_node: int, script: str | None = None) -> int:
    """Run ``python -m planner.cli <cli_args>`` (or ``python <script> <cli_args>``) on local ranks.

    Uses ``torch.distributed.run`` (what the ``torchrun`` command runs) with a
    standalone rendezvous on a free local port.

    Returns:
        0 if every rank succeeded, 130 if the launcher was interrupted (the
        ranks get the signal too), else the first failing rank's exit code.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one compute thread per rank
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    entry = [script] if script else ["--module", "planner.cli"]
    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc_per_node}", *entry, *cli_args]
    )
    try:
        run(args)
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        return next((c for c in codes if c), 1)
    except SignalException:  # Ctrl-C / SIGTERM: the ranks were signalled too and said what they did
        return 130
    return 0


def init_rank(backend: str, timeout_s: float = 900.0) -> Any:
    """Initialize the process group and a 1-D device mesh over every rank.

    ``timeout_s`` bounds every collective of the process group (a rank waits
    at most that long for its peers). On CPU, one compute thread per rank
    (``torch.set_num_threads(1)``).
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if backend == "nccl" else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return init_device_mesh(device, (dist.get_world_size(),))


def shutdown_rank(together: bool = True) -> None:
    """Collect garbage, wait for the other ranks, then destroy the process group.

    FSDP2's states hold reference cycles (``FSDPCommContext.post_forward_order``),
    so a dropped model is freed only by the cycle collector, at worst at
    interpreter exit, after the process group is gone; with gloo that aborted a
    rank now and then ("terminate called without an active exception", about
    1 run in 10). Callers drop their references to the workload first. A rank
    that tears its gloo connections down while a peer is still finishing its
    last collective aborted the same way (1 CI run in ~10), so the ranks meet
    at a barrier first (at most 30 s, ``monitored_barrier`` on gloo).

    Args:
        together: the ranks ended their work together. ``False`` after an
            error: they may have issued different collectives, so no barrier.
    """
    import gc

    import torch.distributed as dist

    gc.collect()
    if not dist.is_initialized():
        return
    if together:
        with contextlib.suppress(Exception):  # a peer that is gone: nothing to wait for
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
            else:
                dist.barrier()
    dist.destroy_process_group()


def tune_rank(config: StudyConfig, plan_out: str, profile_out: str, progress: bool = True) -> None:
    """One rank of a tuning job: record, (rank 0) search, a measured round, (rank 0) write the plan.

    Raises:
        PlannerError: bad workload or storage, or a failure broadcast by rank 0.
        TrialFailedError: a rank raised while measuring (``runtime.protocol``).
        KeyboardInterrupt: SIGINT or SIGTERM; the round's trials are FAIL.
    """
    import torch.distributed as dist
    from tqdm import tqdm

    from planner.plan import Plan
    from planner.simulator import simulate
    from planner.storages import open_storage
    from planner.study import MeasuredStage, latest_calibration, select_candidates, simulated_stage
    from runtime.interrupts import interrupts_deferred, interrupts_raise
    from runtime.protocol import control_group, measured_round, one_line
    from runtime.recorder import record_profile
    from runtime.workload import build_workload

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    mesh = init_rank(config.launch.backend, config.launch.timeout_s)
    group = control_group(config.launch.timeout_s)
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    workload = None
    stages: list[MeasuredStage] = []
    ended = False
    try:
        with interrupts_raise():
            try:
                workload = build_workload(config.workload.factory, mesh, config.workload.kwargs)
                say(f"[1/3] recording a profile on {dist.get_world_size()} ranks ({config.workload.factory})", flush=True)
                profile = record_profile(
                    workload, warmup_steps=max(1, config.measure.warmup_steps), steps=config.measure.steps,
                    repeats=config.measure.profile_repeats,
                )
                job = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"

                def prepare():
                    nonlocal profile
                    profile.to_json(profile_out)
                    default = simulate(profile, Plan.default(profile))
                    exposed = profile.measured_step_ms - default.compute_ms
                    say(f"      measured step {profile.measured_step_ms:.1f} ms with FSDP2's default, of which "
                        f"{exposed:.1f} ms ({100 * exposed / profile.measured_step_ms:.0f}%) is not compute "
                        "(exposed communication and overhead)")
                    say(f"      simulated default: "
                        f"step {default.step_ms:.1f} ms, exposed communication {default.exposed_comm_ms:.1f} ms, "
                        f"lower bound {default.lower_bound_ms:.1f} ms; profile written to {profile_out}")
                    storage = open_storage(config.storage_url, config)
                    calibration = latest_calibration(storage, config.name, profile)
                    if calibration:
                        profile = dataclasses.replace(profile, calibration=calibration)
                        say("      using the calibration of an earlier run of this study: "
                            + ", ".join(f"{k} {v:.3g}" for k, v in calibration.items()))
                    say(f"[2/3] simulated stage: {config.search.sim_trials} trials ({config.search.space} space)", flush=True)
                    sim = simulated_stage(profile, config, storage, show_progress_bar=progress)
                    stage = MeasuredStage(config, storage, profile, job)
                    stages.append(stage)
                    with interrupts_deferred():  # trials created RUNNING are held by `stage` (fail_held)
                        retries = stage.claim_retries()
                    if retries:
                        say(f"      resuming: {len(retries)} plan(s) of stale trials re-queued "
                            f"(trials {', '.join(str(r.retry_of) for r in retries)})")
                    candidates = select_candidates(sim, profile, config.search.space, config.search.measured_trials,
                                                   exclude=stage.settled_keys())
                    if any(r.plan.is_default_for(profile) for r in retries):
                        candidates = candidates[1:]
                    with interrupts_deferred():
                        asked = retries + stage.ask(candidates)
                    say(f"[3/3] measured stage: {len(asked)} plans x ({config.measure.warmup_steps} warm-up + "
                        f"{config.measure.steps} timed steps), interleaved; trials "
                        f"{', '.join(str(a.number) for a in asked)} (job {job})", flush=True)
                    return stage, asked

                bar = tqdm(desc="measured", unit="step", disable=rank != 0 or not progress)
                try:
                    result = measured_round(workload, prepare if rank == 0 else None, config.measure.steps,
                                            config.measure.warmup_steps, group, bar.update)
                finally:
                    bar.close()
                if rank == 0:
                    for number, reason in result.failed.items():
                        say(f"trial {number} FAIL: {reason}")
                    _finish(config, stages[0], result.told, profile, profile_out, plan_out)
                ended = True
            except BaseException as e:
                # No trial of this job stays RUNNING, whatever stopped it (Ctrl-C, SIGTERM, a lost rank,
                # a storage error), also one created before the round was handed out. Inside
                # interrupts_raise, so torchrun's follow-up SIGTERM cannot cut this short.
                for stage in stages:
                    with contextlib.suppress(Exception):
                        stage.fail_held(f"interrupted: {one_line(e)}", "interrupted")
                raise
    finally:
        workload = None
        for stage in stages:
            stage.close()
        shutdown_rank(together=ended)


def _finish(config: StudyConfig, stage: Any, told: list, profile: Any, profile_out: str, plan_out: str) -> None:
    """Rank 0 after a measured round: report, write the best plan, calibrate."""
    from planner.calibrate import Observation, calibrated, errors_pct, fit, summary
    from planner.study import best_plan

    if not told:
        print("no plan was measured in this job; nothing written")
        return
    _report(told, plan_out, profile)
    study_best, _ = best_plan(config.storage_url, config.name)
    print(f"study-wide best so far: trial {study_best.provenance.trial}, {study_best.provenance.measured_ms:.1f} ms "
          f"(`prefetch-planner studies best {config.name}`)")
    observations = [Observation(p, p.provenance.measured_ms) for p in told]
    if len(observations) >= 2:
        uncalibrated = dataclasses.replace(profile, calibration=None)
        before = errors_pct(uncalibrated, observations)
        profile = calibrated(profile, fit(uncalibrated, observations))
        after = errors_pct(profile, observations)
        stage.save_calibration(profile)
        profile.to_json(profile_out)
        print(f"calibration on these {len(observations)} measured plans: {summary(before)} before, "
              f"{summary(after)} after; saved with the profile for later runs")


def profile_rank(config: StudyConfig, output: str, torch_trace: str | None = None) -> None:
    """One rank of ``prefetch-planner profile``: record, rank 0 writes the JSON.

    With ``torch_trace``, one more default-plan step runs under
    ``torch.profiler`` and rank 0 exports its Chrome trace there, to compare
    with ``prefetch-planner simulate --trace`` track by track.
    """
    import torch
    import torch.distributed as dist

    from planner.plan import Plan
    from planner.simulator import simulate
    from runtime.recorder import record_profile
    from runtime.workload import build_workload, train_step

    mesh = init_rank(config.launch.backend)
    workload = None
    ended = False
    try:
        workload = build_workload(config.workload.factory, mesh, config.workload.kwargs)
        profile = record_profile(workload, warmup_steps=max(1, config.measure.warmup_steps), steps=config.measure.steps,
                                 repeats=config.measure.profile_repeats)
        if torch_trace:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                train_step(workload, 0)
            if dist.get_rank() == 0:
                prof.export_chrome_trace(torch_trace)
        if dist.get_rank() == 0:
            profile.to_json(output)
            r = simulate(profile, Plan.default(profile))
            print(f"profile written to {output}: {len(profile.modules)} FSDP modules, measured step "
                  f"{profile.measured_step_ms:.1f} ms (FSDP2 default), predicted {r.step_ms:.1f} ms")
        ended = True
    finally:
        workload = None
        shutdown_rank(together=ended)


def _report(plans: list, plan_out: str, profile: Any) -> None:
    default_ms = plans[0].provenance.default_measured_ms
    print(f"\n  {'trial':>5}  {'predicted ms':>12}  {'measured ms':>11}  {'vs default':>10}  plan")
    for p in plans:
        pv = p.provenance
        ratio = pv.measured_ms / default_ms if default_ms else float("nan")
        label = "FSDP2 default" if p.is_default_for(profile) else _describe(p)
        print(f"  {pv.trial:>5}  {pv.predicted_ms:>12.1f}  {pv.measured_ms:>11.1f}  {ratio:>10.3f}  {label}")
    best = min(plans, key=lambda p: p.provenance.measured_ms)
    best.to_json(plan_out)
    ratio = best.provenance.measured_ms / default_ms if default_ms else float("nan")
    print(f"\nbest plan: trial {best.provenance.trial}, {best.provenance.measured_ms:.1f} ms vs FSDP2 default "
          f"{default_ms:.1f} ms (ratio {ratio:.3f}); written to {plan_out}")


def _describe(plan) -> str:
    """A short human description of a plan (prefetch depths, async)."""
    fwd = max(len(m.forward_prefetch) for m in plan.modules.values())
    bwd = max(max(1, len(m.backward_prefetch)) for m in plan.modules.values())
    return f"forward prefetch {fwd or 'implicit'}, backward prefetch {bwd}, async unshard {plan.unshard_async_op}"


def rank_error(e: BaseException) -> None:
    """Exit on a rank's error; rank 0 prints the one line.

    Bad input (a factory that raises, a model without ``fully_shard``) fails
    alike on every rank, and a :class:`planner.TrialFailedError` carries the
    same message on every rank, so one line is enough. Exit codes: the
    error's ``exit_code`` (2 bad input, 1 a failed trial), 130 interrupted.
    """
    if isinstance(e, KeyboardInterrupt):
        message = (f"interrupted ({e or 'SIGINT'}); the measured trials that were running are recorded as FAIL; "
                   "run `prefetch-planner tune` again to resume the study")
        code = 130
    else:
        message, code = str(e), getattr(e, "exit_code", 2)
    rank = os.environ.get("RANK", "0")
    if rank == "0":
        print(f"error: {message}", file=sys.stderr, flush=True)
    elif getattr(e, "local", False):  # e.g. rank 0 died: nobody else would say it
        print(f"error: rank {rank}: {message}", file=sys.stderr, flush=True)
    sys.exit(code)
