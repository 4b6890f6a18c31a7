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

from planner.simulation.calibrate import CalibrationResult, Observation, calibrate
from planner.artifacts.config import StudyConfig
from jobs.outputs import check_output_folders
from planner.errors import FailKind
from planner.simulation.in_step import in_step_params
from planner.artifacts.memory_budget import check_feasible, mib
from planner.artifacts.plan import Plan
from planner.artifacts.profile import Profile
from planner.statistics.race import Race
from planner.simulation.parameters import simulate
from planner.storages import check_writable, open_storage
from planner.storages.archive import latest_calibration
from planner.study import (
    MeasuredStage, MeasuredTrial, select_candidates, simulated_stage, smallest_peak,
)
from planner.statistics.verdict import Verdict, detectable_effect
from runtime.interrupts import interrupts_deferred, interrupts_raise
from runtime.protocol import RoundResult, control_group, measured_round, one_line
from runtime.rank import check_runnable, init_rank, shutdown_rank
from runtime.recorder import record_profile
from runtime.workload import Workload, build_study_workload, load_factory
from search_spaces import get_space

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TuneOutcome:
    """What a tuning job leaves (rank 0).

    Attributes:
        told: the plans measured in this job, provenance filled in, in
            measurement order, FSDP2's default first (empty when nothing was measured).
        failed: trial number -> why applying its plan failed on some rank.
        profile: the profile as written (calibrated when the calibration was accepted).
        profile_out: where it was written.
        race: the race (rounds, drops, noise); ``None`` when nothing was measured.
        candidate: the race's survivor, confirmed against the default (its
            provenance has the verdict); ``None`` if every candidate was dropped.
        written: the plan written to ``plan_out``: ``candidate`` when its
            verdict is "faster", else FSDP2's default; ``None`` when nothing was measured.
        plan_out: where it was written.
        calibration: what calibration concluded on ``told``.
    """

    told: list[Plan]
    failed: dict[int, str]
    profile: Profile
    profile_out: str
    race: Race | None
    candidate: Plan | None
    written: Plan | None
    plan_out: str
    calibration: CalibrationResult | None


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
        self._bar: tqdm | None = None

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
                    workload = build_study_workload(self.config.workload, mesh)
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
        self._bar = tqdm(desc="measured", unit="step", disable=not rank0 or not self.progress)
        try:
            return measured_round(workload, self._prepare_round if rank0 else None, self.config.measure.warmup_steps,
                                  group, self._stepped)
        finally:
            self._bar.close()

    def _stepped(self) -> None:
        """Progress: one step more; the total is what the schedule may still run (an ETA at its worst)."""
        bar = self._bar
        schedule = self.stage.schedule if self.stage is not None else None
        if schedule is not None:
            bar.total = bar.n + 1 + schedule.planned_steps()
        bar.update()

    def _dropped(self, trial: MeasuredTrial, rounds: int) -> None:
        race = self.stage.schedule.race
        sigma = race.ratio_sigma()
        self._bar.write(f"      dropped trial {trial.number} after {rounds} rounds: significantly slower than the "
                        f"leader (noise {race.noise_pct():.1f}% step IQR / median; these rounds detect "
                        f"{100 * detectable_effect(sigma, rounds):.1f}%)")

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
        if profile.in_step is not None:
            params = in_step_params(profile)
            logger.info(f"      in-step parameters: comm_scale {params.comm_scale:.2f} (solved from the measured "
                        f"default step), overlap_slowdown {params.overlap_slowdown:.2f} (measured)")
        budget_bytes = self._memory_budget(profile)  # before the storage is opened: a refused budget writes nothing
        storage = open_storage(config.storage_url, config)
        stored = latest_calibration(storage.engine, config.name, profile)
        if stored:
            self.profile = profile = dataclasses.replace(profile, calibration=stored)
            logger.info("      using the calibration of an earlier run of this study: "
                        + ", ".join(f"{k} {v:.3g}" for k, v in stored.items()))
        logger.info(f"[2/3] simulated stage: {config.search.sim_trials} trials ({config.search.space} space)")
        sim = simulated_stage(profile, config, storage, get_space(config.search.space), show_progress_bar=self.progress, budget_bytes=budget_bytes)
        self.stage = MeasuredStage(config, storage, profile, self.job, space, on_drop=self._dropped,
                                   budget_bytes=budget_bytes)
        with interrupts_deferred():  # trials created RUNNING are held by the stage (fail_held)
            retries = self.stage.claim_retries()
        if retries:
            logger.info(f"      resuming: {len(retries)} plan(s) of stale trials re-queued "
                        f"(trials {', '.join(str(r.retry_of) for r in retries)})")
        candidates = select_candidates(sim, profile, space, config.search.measured_trials,
                                       exclude=self.stage.settled_keys(), band_pct=config.search.candidate_band_pct,
                                       budget_bytes=budget_bytes)
        if any(r.plan.is_default_for(profile) for r in retries):
            candidates = candidates[1:]
        with interrupts_deferred():
            asked = retries + self.stage.ask(candidates)
        asked.sort(key=lambda a: not a.plan.is_default_for(profile))  # FSDP2's default first: the race's baseline
        m = config.measure
        logger.info(f"[3/3] measured stage: a race of FSDP2's default and {len(asked) - 1} candidate(s) "
                    f"({m.warmup_steps} warm-up step each, then rounds in balanced order, at most {m.max_rounds}; "
                    f"a candidate significantly slower than the leader is dropped at alpha {m.alpha:g}), then the "
                    f"survivor against the default on {m.confirm_min_rounds}-{m.confirm_max_rounds} fresh rounds; "
                    f"trials {', '.join(str(a.number) for a in asked)} (job {self.job})")
        return self.stage, asked

    def _memory_budget(self, profile: Profile) -> int | None:
        """``[search] memory_budget`` in bytes per rank, checked against the smallest predicted peak; ``None``: unset.

        Raises:
            MemoryBudgetError: relative without a measured default peak, or below every plan's predicted peak.
        """
        budget = self.config.search.budget()
        if budget is None:
            return None
        budget_bytes = budget.resolve(profile.measured_peak_bytes)
        check_feasible(budget_bytes, smallest_peak(profile, get_space(self.config.search.space)), budget.text)
        logger.info(f"      memory budget {budget.text}: {mib(budget_bytes)} per rank (FSDP2's default measured "
                    f"{mib(profile.measured_peak_bytes)}, predicted {mib(simulate(profile, Plan.default(profile)).peak_bytes)})")
        return budget_bytes

    def _finish(self, result: RoundResult) -> TuneOutcome:
        """Rank 0 after the round: write the confirmed plan (or FSDP2's default), calibrate on the measured plans."""
        told = result.told
        schedule = self.stage.schedule if self.stage is not None else None
        if not told or schedule is None:
            return TuneOutcome(told, result.failed, self.profile, self.profile_out, None, None, None, self.plan_out,
                               None)
        survivor = schedule.survivor
        candidate = told[survivor] if survivor is not None and schedule.confirmation is not None else None
        faster = candidate is not None and candidate.provenance.verdict == Verdict.FASTER
        written = candidate if faster else told[0]  # FSDP2's default, as measured in this round
        written.to_json(self.plan_out)
        observations = [Observation(p, p.provenance.measured_ms) for p in told]
        calibration = calibrate(self.profile, observations)
        if calibration.accepted:
            self.profile = calibration.apply(self.profile)
            self.stage.save_calibration(self.profile)
        return TuneOutcome(told, result.failed, self.profile, self.profile_out, schedule.race, candidate, written,
                           self.plan_out, calibration)
