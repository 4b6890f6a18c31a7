"""The tune job: one rank of ``prefetch-planner tune``, wiring the ranks to one tuning session.

Every rank records a profile; rank 0 holds the
:class:`~planner.study.session.TuningSession`, which decides everything
(simulated stage, candidates, schedule, verdict, what is written); the rank
protocol (``runtime.measuring.round``, [Note: Rank protocol of a measured round])
drives it with the ranks' measurements.
"""

from __future__ import annotations

import contextlib
import logging

import torch.distributed as dist
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from jobs import PROGRESS_LOGGERS
from planner.artifacts.config import StudyConfig
from planner.artifacts.profile import Profile
from planner.errors import FailKind, PlanMismatchError, PlannerError, one_line
from planner.study.measured import MeasuredTrial
from planner.study.model_summary import allocator_mismatch
from planner.study.session import TuneOutcome, TuningSession
from runtime.apply import model_fingerprint
from runtime.current import own_plan, record_under_fsdp2_default
from runtime.measuring.measure import measured_round
from runtime.ranks.budget import with_device_budget
from runtime.ranks.failures import FailureBoard
from runtime.ranks.interrupts import interrupts_deferred, interrupts_raise
from runtime.ranks.rank import job_rank
from runtime.recording.recorder import record_profile
from runtime.timing import step_failure
from runtime.workload import Workload, build_study_workload
from search_spaces.session import open_session, optuna_quiet

logger = logging.getLogger(__name__)


class TuneJob:
    """One rank of a tuning job: record, then (rank 0) a tuning session driven by a measured round.

    Args:
        config: the study.
        plan_out: where rank 0 writes the round's best plan.
        profile_out: where rank 0 writes the profile.
        progress: show progress bars (rank 0).
        job: the job's name (default: a new one, ``planner.study.measured.job_name``; every rank must get the same).
        confirm_launches: fresh launches the launching process confirms the survivor in; ``0``: confirmed in
            this job's processes after the race; ``None``: as many as the confirmation's design chooses.
        profile_in: a profile to tune from instead of recording one (``profile --from-trace``'s, or an earlier
            job's); its fingerprint must be the model's.
    """

    def __init__(self, config: StudyConfig, plan_out: str, profile_out: str, progress: bool = True,
                 job: str | None = None, confirm_launches: int | None = 0, profile_in: str | None = None):
        self.config = config
        self.plan_out = plan_out
        self.profile_out = profile_out
        self.progress = progress
        self.job = job
        self.confirm_launches = confirm_launches
        self.profile_in = profile_in
        self.session: TuningSession | None = None
        self._bar: tqdm | None = None
        self._bar_blocks = 0  # the schedule's blocks the bar's total was set at
        self._warm_up_steps: int | None = None  # the measured round's warm-up steps, once it says

    def run(self) -> TuneOutcome | None:
        """Run this rank's part (every rank calls it); rank 0 returns the outcome, the others ``None``.

        Raises:
            PlannerError: bad workload or storage, or a failure broadcast by rank 0.
            TrialFailedError: a rank raised while measuring (``runtime.measuring.round``).
            KeyboardInterrupt: SIGINT or SIGTERM; the round's trials are FAIL.
        """
        with optuna_quiet():
            return self._run()

    def _run(self) -> TuneOutcome | None:
        launch = self.config.launch
        with job_rank(launch) as rank:
            mesh, group, rank0 = rank.mesh, rank.group, rank.rank0
            workload: Workload | None = None
            board = FailureBoard.open(group, launch.stuck_after_s)  # [Note: A failed step on some ranks]
            try:
                with interrupts_raise():
                    try:
                        workload = build_study_workload(self.config.workload, mesh)
                        device_type = next(workload.model.parameters()).device.type
                        self.config, line = with_device_budget(self.config, device_type, group)
                        if line is not None and rank0:
                            logger.info(line)
                        user_plan = own_plan(workload.model)  # the race's baseline where the factory sets a plan
                        profile = self._record(workload)
                        if rank0:
                            self.session = self._session(profile)
                            self.session.user_plan = user_plan
                        result = self._measure(workload, group, rank0, board)
                        outcome = self.session.finish(result.plans_measured, result.failed) if rank0 else None
                        rank.ended = True
                        return outcome
                    except BaseException as e:
                        if isinstance(e, Exception) and not isinstance(e, PlannerError):
                            board.leave(step_failure(None, e))  # a peer left waiting in a collective is stopped
                        # No trial of this job stays RUNNING, whatever stopped it (Ctrl-C, SIGTERM, a lost rank,
                        # a storage error), also one created before the round was handed out. Inside
                        # interrupts_raise, so torchrun's follow-up SIGTERM cannot cut this short.
                        if self.session is not None:
                            with contextlib.suppress(Exception):
                                self.session.fail_held(f"interrupted: {one_line(e)}", FailKind.INTERRUPTED)
                        raise
            finally:
                board.close()
                workload = None
                if self.session is not None:
                    self.session.close()
                    self.session.save_profile()  # once, calibrated if the round got that far

    def _record(self, workload: Workload) -> Profile:
        if self.profile_in is not None:
            return self._given_profile(workload)
        measure = self.config.measure
        logger.info(f"[1/3] recording a profile on {dist.get_world_size()} ranks ({self.config.workload.factory})")
        record_under_fsdp2_default(workload.model)  # a factory's own plan: the profile is FSDP2's default's
        return record_profile(workload, warmup_steps=max(1, measure.warmup_steps), steps=measure.steps,
                              repeats=measure.profile_repeats, budget=self.config.search.budget(),
                              collectives=measure.collectives)

    def _given_profile(self, workload: Workload) -> Profile:
        """The ``profile_in`` profile, checked against the model on every rank.

        Raises:
            PlanMismatchError: the profile was made for another model, world size or torch.
        """
        profile = Profile.load(self.profile_in)
        difference = profile.fingerprint.first_difference(model_fingerprint(workload.model))
        if difference is not None:
            raise PlanMismatchError(f"profile {self.profile_in!r} is not of this study's model: {difference}; build "
                                    "it with --model (prefetch-planner profile --from-trace ... --model FACTORY)")
        mismatch = allocator_mismatch(profile, self.config.launch.allocator, self.profile_in)
        if mismatch is not None:
            logger.warning(mismatch)
        source = f"{profile.source}, estimated: {', '.join(profile.estimated)}" if profile.estimated else profile.source
        logger.info(f"[1/3] tuning from the profile {self.profile_in} ({source}); nothing recorded")
        return profile

    def _session(self, profile: Profile) -> TuningSession:
        return open_session(self.config, profile, job=self.job, plan_out=self.plan_out,
                            profile_out=self.profile_out, progress=self.progress, on_drop=self._dropped,
                            critical=interrupts_deferred, confirm_launches=self.confirm_launches)

    def _measure(self, workload: Workload, group: dist.ProcessGroup, rank0: bool, board: FailureBoard):
        """The measured round, its progress bar drawn from the first measured step.

        The simulated stage runs inside the round (rank 0, on the first ask), with its own bar and log lines: a
        bar drawn before it would sit under Optuna's and split the lines. While the bar is drawn, the progress
        loggers' records go through ``tqdm.write`` (``logging_redirect_tqdm``), so a line never lands on the bar.
        """
        self._bar, self._bar_blocks, self._warm_up_steps = None, 0, None
        loggers = [logging.getLogger(name) for name in PROGRESS_LOGGERS]
        try:
            with logging_redirect_tqdm(loggers=loggers):
                shown = rank0 and self.progress
                result = measured_round(workload, self.session, self.config.measure.warmup_steps, group,
                                        self._stepped if shown else None, self._warming_up if shown else None, board)
            if self._bar is not None:  # the schedule may end before its worst case: the bar ends full
                self._bar.total = self._bar.n
            return result
        finally:
            if self._bar is not None:
                self._bar.close()

    def _warming_up(self, steps: int) -> None:
        """Progress: the warm-up's steps, the bar's total until the schedule exists (drawn at the first step)."""
        self._warm_up_steps = steps

    def _stepped(self) -> None:
        """Progress: one step more. The bar reads ``warm-up``, its total the warm-up's steps, until the schedule
        exists; then ``measured``, its total set at each block's first step to the steps run before it and what the
        schedule may still run (this block included: an ETA at its worst), and held within the block."""
        if self._bar is None:
            desc = "measured" if self._warm_up_steps is None else "warm-up"
            self._bar = tqdm(desc=desc, unit="step", total=self._warm_up_steps)
        bar = self._bar
        schedule = self.session.schedule if self.session is not None else None
        if schedule is not None and schedule.blocks != self._bar_blocks:
            self._bar_blocks = schedule.blocks
            bar.set_description_str("measured", refresh=False)
            bar.total = bar.n + schedule.planned_steps()
        bar.update()

    def _dropped(self, trial: MeasuredTrial, rounds: int) -> None:
        race = self.session.schedule.race
        tqdm.write(f"      dropped trial {trial.number} after {rounds} rounds: significantly slower than the "
                   f"leader (noise {race.noise_pct():.1f}% step IQR / median; this look's test drops a plan "
                   f"{100 * race.detectable_slowdown():.1f}% slower with 80% power)")
