"""The tune job: one rank of ``prefetch-planner tune``, wiring the runtime (ranks, recorder, rank protocol) to the planner (study).

Every rank records a profile; rank 0 alone runs the simulated stage, asks
the measured study for the round's trials, and tells it the results
(``runtime.protocol``, [Note: Rank protocol of a measured round]). Rank 0
then writes the best plan of the round and the (calibrated) profile, each
once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import uuid
from dataclasses import dataclass

import optuna
import torch.distributed as dist
from tqdm import tqdm

from planner.calibrate import Observation, calibrated, errors_pct, fit
from planner.config import StudyConfig
from jobs.outputs import check_output_folders
from planner.errors import FailKind
from planner.plan import Plan
from planner.profile import Profile
from planner.simulator import simulate
from planner.storages import check_writable, open_storage
from planner.study import MeasuredStage, MeasuredTrial, best_plan, latest_calibration, select_candidates, simulated_stage
from runtime.interrupts import interrupts_deferred, interrupts_raise
from runtime.protocol import RoundResult, control_group, measured_round, one_line
from runtime.rank import check_runnable, init_rank, shutdown_rank
from runtime.recorder import record_profile
from runtime.workload import Workload, build_workload, load_factory

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Calibration:
    """A calibration fitted after the round: signed prediction errors (%) per measured plan, before and after."""

    before_pct: list[float]
    after_pct: list[float]


@dataclass(frozen=True)
class TuneOutcome:
    """What a tuning job leaves (rank 0).

    Attributes:
        told: the plans measured in this job, provenance filled in, in
            measurement order (empty when nothing was measured).
        failed: trial number -> why applying its plan failed on some rank.
        profile: the profile as written (calibrated when ``calibration``).
        profile_out: where it was written.
        best: the round's fastest plan, written to ``plan_out``; ``None``
            when nothing was measured.
        plan_out: where the best plan was written.
        study_best: the study's best plan over every job so far.
        calibration: the calibration fitted on ``told`` (2 plans or more).
    """

    told: list[Plan]
    failed: dict[int, str]
    profile: Profile
    profile_out: str
    best: Plan | None
    plan_out: str
    study_best: Plan | None
    calibration: Calibration | None


class TuneJob:
    """One rank of a tuning job: record, (rank 0) simulate and ask, a measured round, (rank 0) write and calibrate.

    Args:
        config: the study.
        plan_out: where rank 0 writes the round's best plan.
        profile_out: where rank 0 writes the profile.
        progress: show progress bars (rank 0).
    """

    def __init__(self, config: StudyConfig, plan_out: str, profile_out: str, progress: bool = True):
        self.config = config
        self.plan_out = plan_out
        self.profile_out = profile_out
        self.progress = progress
        self.job = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.profile: Profile | None = None
        self.stage: MeasuredStage | None = None

    @staticmethod
    def check_before_launch(config: StudyConfig, *outputs: str) -> None:
        """What the launching process checks before it starts any rank; writes nothing.

        Raises:
            WorkloadError: the factory cannot be imported.
            StudyConfigError: this machine cannot run the study's ranks.
            StorageError: the storage is unreachable, its driver missing, or locked.
            PlannerError: an output's folder does not exist.
        """
        load_factory(config.workload.factory)
        check_runnable(config.launch.backend, config.launch.nproc_per_node)
        check_writable(config.storage_url)
        check_output_folders(*outputs)

    def run(self) -> TuneOutcome | None:
        """Run this rank's part (every rank calls it); rank 0 returns the outcome, the others ``None``.

        Raises:
            PlannerError: bad workload or storage, or a failure broadcast by rank 0.
            TrialFailedError: a rank raised while measuring (``runtime.protocol``).
            KeyboardInterrupt: SIGINT or SIGTERM; the round's trials are FAIL.
        """
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        launch = self.config.launch
        mesh = init_rank(launch.backend, launch.timeout_s)
        group = control_group(launch.timeout_s)
        rank0 = dist.get_rank() == 0
        workload: Workload | None = None
        ended = False
        try:
            with interrupts_raise():
                try:
                    workload = build_workload(self.config.workload.factory, mesh, self.config.workload.kwargs)
                    self.profile = self._record(workload)
                    result = self._measure(workload, group, rank0)
                    outcome = self._finish(result) if rank0 else None
                    ended = True
                    return outcome
                except BaseException as e:
                    # No trial of this job stays RUNNING, whatever stopped it (Ctrl-C, SIGTERM, a lost rank,
                    # a storage error), also one created before the round was handed out. Inside
                    # interrupts_raise, so torchrun's follow-up SIGTERM cannot cut this short.
                    if self.stage is not None:
                        with contextlib.suppress(Exception):
                            self.stage.fail_held(f"interrupted: {one_line(e)}", FailKind.INTERRUPTED)
                    raise
        finally:
            workload = None
            if self.stage is not None:
                self.stage.close()
            if rank0 and self.profile is not None:
                self.profile.to_json(self.profile_out)  # once, calibrated if the round got that far
            shutdown_rank(together=ended)

    def _record(self, workload: Workload) -> Profile:
        measure = self.config.measure
        logger.info(f"[1/3] recording a profile on {dist.get_world_size()} ranks ({self.config.workload.factory})")
        return record_profile(workload, warmup_steps=max(1, measure.warmup_steps), steps=measure.steps,
                              repeats=measure.profile_repeats)

    def _measure(self, workload: Workload, group: dist.ProcessGroup, rank0: bool) -> RoundResult:
        measure = self.config.measure
        bar = tqdm(desc="measured", unit="step", disable=not rank0 or not self.progress)
        try:
            return measured_round(workload, self._prepare_round if rank0 else None, measure.steps,
                                  measure.warmup_steps, group, bar.update)
        finally:
            bar.close()

    def _prepare_round(self) -> tuple[MeasuredStage, list[MeasuredTrial]]:
        """Rank 0, step 1 of the rank protocol: simulate, then ask the study for the round's trials."""
        config, profile = self.config, self.profile
        default = simulate(profile, Plan.default(profile))
        exposed = profile.measured_step_ms - default.compute_ms
        logger.info(f"      measured step {profile.measured_step_ms:.1f} ms with FSDP2's default, of which "
                    f"{exposed:.1f} ms ({100 * exposed / profile.measured_step_ms:.0f}%) is not compute "
                    "(exposed communication and overhead)")
        logger.info(f"      simulated default: step {default.step_ms:.1f} ms, exposed communication "
                    f"{default.exposed_comm_ms:.1f} ms, lower bound {default.lower_bound_ms:.1f} ms")
        storage = open_storage(config.storage_url, config)
        stored = latest_calibration(storage, config.name, profile)
        if stored:
            self.profile = profile = dataclasses.replace(profile, calibration=stored)
            logger.info("      using the calibration of an earlier run of this study: "
                        + ", ".join(f"{k} {v:.3g}" for k, v in stored.items()))
        logger.info(f"[2/3] simulated stage: {config.search.sim_trials} trials ({config.search.space} space)")
        sim = simulated_stage(profile, config, storage, show_progress_bar=self.progress)
        self.stage = MeasuredStage(config, storage, profile, self.job)
        with interrupts_deferred():  # trials created RUNNING are held by the stage (fail_held)
            retries = self.stage.claim_retries()
        if retries:
            logger.info(f"      resuming: {len(retries)} plan(s) of stale trials re-queued "
                        f"(trials {', '.join(str(r.retry_of) for r in retries)})")
        candidates = select_candidates(sim, profile, config.search.space, config.search.measured_trials,
                                       exclude=self.stage.settled_keys())
        if any(r.plan.is_default_for(profile) for r in retries):
            candidates = candidates[1:]
        with interrupts_deferred():
            asked = retries + self.stage.ask(candidates)
        logger.info(f"[3/3] measured stage: {len(asked)} plans x ({config.measure.warmup_steps} warm-up + "
                    f"{config.measure.steps} timed steps), interleaved; trials "
                    f"{', '.join(str(a.number) for a in asked)} (job {self.job})")
        return self.stage, asked

    def _finish(self, result: RoundResult) -> TuneOutcome:
        """Rank 0 after the round: write the round's best plan, calibrate on the measured plans."""
        told, calibration, best, study_best = result.told, None, None, None
        if told:
            best = min(told, key=lambda p: p.provenance.measured_ms)
            best.to_json(self.plan_out)
            study_best, _ = best_plan(self.config.storage_url, self.config.name)
        if len(told) >= 2:
            observations = [Observation(p, p.provenance.measured_ms) for p in told]
            uncalibrated = dataclasses.replace(self.profile, calibration=None)
            before = errors_pct(uncalibrated, observations)
            self.profile = calibrated(self.profile, fit(uncalibrated, observations))
            calibration = Calibration(before, errors_pct(self.profile, observations))
            self.stage.save_calibration(self.profile)
        return TuneOutcome(told, result.failed, self.profile, self.profile_out, best, self.plan_out, study_best,
                           calibration)

