"""One tuning session: everything a tuning job decides, torch-free, driven by the measurements handed to it.

The session holds a recorded profile and decides, in order: the memory
budget (refused before the storage is touched), whether an earlier
calibration of the study applies, the simulated stage, which stale trials to
re-measure and which candidates to race, the race and confirmation schedule,
which plans exceed the budget as measured, what each measured plan's
provenance and trial record say, the plan written (the confirmed survivor if
it is faster, else the baseline), and whether the new calibration is kept.

[Note: The user's plan is the baseline]
A tuner's promise is a plan faster than what the user has, and many models
arrive with a plan of their own (prefetch depths set by NeMo-Automodel or
verl, ``reshard_after_forward`` chosen by hand: ``runtime.current_plan``
reads it back). The profile is FSDP2's default's, as it claims; the race's
baseline, what every verdict of the job compares against (position 0 of
the schedule), is the plan the model arrived with, raced as a trial
without search-space parameters (``user_plan``); FSDP2's default is raced
as a candidate like the others, so it can be confirmed faster than the
user's plan too. When nothing is confirmed faster than the baseline, the
study recommends the baseline and the model keeps it, exactly as it was:
the tuner never hands back a slower plan than the user's on its own
verdict. A model that arrives with FSDP2's default has it as its baseline.

Whoever runs the ranks drives it through the rank protocol
(``runtime.measuring.round``, [Note: Rank protocol of a measured round]):
:meth:`TuningSession.prepare`, :meth:`~TuningSession.over_budget`,
:meth:`~TuningSession.start`, the schedule's blocks,
:meth:`~TuningSession.tell` (or :meth:`~TuningSession.fail`), then
:meth:`~TuningSession.finish`; ``jobs.tune`` does so for ``prefetch-planner
tune``. The tests drive it with synthetic step times (``planner.testing``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from planner.artifacts.config import StudyConfig
from planner.artifacts.memory_budget import PeakBudget
from planner.artifacts.plan import Plan, baseline_name
from planner.artifacts.profile import Profile
from planner.errors import FailKind, PlannerError
from planner.simulation.calibrate import CalibrationResult, Observation, calibrate
from planner.simulation.parameters import simulator_for
from planner.simulation.simulator import Simulator
from planner.statistics.design import ConfirmDesign
from planner.statistics.race import Race
from planner.statistics.schedule import Schedule
from planner.statistics.verdict import Confirmation
from planner.storages import open_storage, storage_errors
from planner.storages.archive import with_stored_calibration
from planner.study.budget import fail_over_budget, job_budget
from planner.study.candidates import round_candidates
from planner.study.cluster_spread import ClusterKey, ClusterSpread, cluster_spread
from planner.study.earlier_jobs import EarlierJobs
from planner.study.evidence import round_schedule
from planner.study.measured import MeasuredStage, MeasuredTrial
from planner.study.model_summary import model_summary
from planner.study.provenance import measured_plans
from planner.study.queries import BestPlan
from planner.study.records import Failure
from planner.study.search_space import SearchSpace
from planner.study.simulated import simulated_stage

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class TuneOutcome:
    """What a tuning session leaves.

    Attributes:
        plans_measured: the plans measured, provenance filled in, in measurement order,
            the baseline first (empty when nothing was measured).
        failed: trial number -> why its plan failed (applying it on some rank, or the memory budget).
        profile: the profile as it ends (calibrated when the calibration was accepted).
        profile_out: where the profile is written.
        race: the race (rounds, drops, noise); ``None`` when nothing was measured.
        candidate: the race's survivor (its provenance has the verdict once confirmed here); ``None`` if every
            candidate was dropped.
        written: the plan written to ``plan_out``: the study's recommendation once this job is decided
            (``planner.study.queries.best_plan``), the baseline while the survivor awaits its launches;
            ``None`` when nothing was measured.
        plan_out: where it was written.
        calibration: what calibration concluded on ``plans_measured``; ``None`` when nothing was measured.
        best: the study's recommendation once this job is decided; ``None`` while its survivor awaits its
            confirmation launches, or when nothing was measured.
        confirmation: the survivor's confirmation when it ran here (in this process); ``None`` otherwise.
        design: the survivor's confirmation's size (launches, rounds, the chain's horizon, power); ``None`` when
            nothing survived.
        cluster: the cluster's spread the verdicts use (its calibration, else its device's prior).
    """

    plans_measured: list[Plan]
    failed: dict[int, str]
    profile: Profile
    profile_out: str
    race: Race | None = None
    candidate: Plan | None = None
    written: Plan | None = None
    plan_out: str
    calibration: CalibrationResult | None = None
    best: BestPlan | None = None
    confirmation: Confirmation | None = None
    design: ConfirmDesign | None = None
    cluster: ClusterSpread | None = None


class TuningSession:
    """The decisions of one tuning job on a recorded profile (module docstring).

    Args:
        config: the study.
        profile: the profile recorded for this job.
        space: the search space (``search_spaces.get_space(config.search.space)``).
        job: this job's name (trial user attribute ``job``).
        plan_out: where :meth:`finish` writes the plan.
        profile_out: where :meth:`save_profile` writes the profile.
        progress: show the simulated stage's progress bar.
        on_drop: called with a dropped trial and the rounds run (progress reports).
        critical: a context manager factory around the writes that create trials RUNNING (claiming retries,
            asking), which an interrupt must not cut in two: the runtime's ``interrupts_deferred``.
        confirm_launches: fresh launches the survivor's confirmation runs in after this job
            (``planner.study.confirmation``); ``0``: confirmed here, after the race; ``None``: as many as the
            confirmation's design chooses (``planner.statistics.design``).
        source: what measures the trials (trial attribute ``source``): ``"tune"``, or ``"in-loop"`` for
            ``runtime.AutoTuner`` in a user's training loop.

    Attributes:
        profile: the profile as it stands (with a stored calibration once :meth:`prepare` found one).
        simulator: the profile's simulator (set by :meth:`prepare`).
        budget: the memory budget, what a candidate is charged under it (set by :meth:`prepare`; ``None``: none).
        schedule: the round's schedule (set by :meth:`start`).
        start_from: a plan predicted for this cluster (``tune --target``), set before :meth:`prepare`: raced first
            among the candidates ([Note: Predicted plans are raced, never recommended] in
            ``planner.study.predicted``); ``None``: none.
        user_plan: the plan the model arrived with when it is not FSDP2's default (``runtime.current_plan``), set
            before :meth:`prepare`: the round's baseline ([Note: The user's plan is the baseline]); ``None``: FSDP2's
            default is the baseline.
    """

    def __init__(self, config: StudyConfig, profile: Profile, space: SearchSpace, *, job: str, plan_out: str,
                 profile_out: str, progress: bool = False,
                 on_drop: Callable[[MeasuredTrial, int], None] | None = None,
                 critical: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 confirm_launches: int | None = 0, source: str = "tune"):
        self.config, self.profile, self.space, self.job, self.source = config, profile, space, job, source
        self.start_from: Plan | None = None
        self.user_plan: Plan | None = None
        self.confirm_launches = confirm_launches
        self.plan_out, self.profile_out, self.progress, self.on_drop = plan_out, profile_out, progress, on_drop
        self.critical = critical
        self.simulator: Simulator | None = None
        self.budget: PeakBudget | None = None
        self.stage: MeasuredStage | None = None
        self.earlier: EarlierJobs | None = None
        self.cluster: ClusterSpread | None = None
        self.schedule: Schedule | None = None
        self._started: list[MeasuredTrial] = []
        self._peaks: list[int] = []

    def prepare(self) -> list[MeasuredTrial]:
        """The round's trials, the baseline first ([Note: The user's plan is the baseline]): re-queued plans of dead
        jobs, then the candidates in the order of [Note: The round's candidates in order] in
        ``planner.study.candidates`` (plans a stopped job left unmeasured within ``[search] measured_trials``).

        Raises:
            MemoryBudgetError: the budget is relative without a measured default peak, or below every plan's
                predicted peak (nothing is written).
            PlanMismatchError: :attr:`user_plan` is not a plan of the profile's model.
            StorageError: the storage cannot be opened or written.
        """
        config = self.config
        self.simulator = simulator_for(self.profile)
        self._log_model()
        # before the storage is opened: a refused budget writes nothing
        self.budget = job_budget(config, self.profile, self.simulator, self.space)
        storage = open_storage(config.storage_url, config)
        with storage_errors(config.storage_url):  # Optuna's writes here raise its StorageInternalError
            self.cluster = cluster_spread(storage.engine, ClusterKey.of(self.profile.fingerprint,
                                                                        config.launch.backend))
            logger.info(f"      {self.cluster.line()}")
            calibrated = with_stored_calibration(storage.engine, config.name, self.profile)
            if calibrated is not self.profile:  # a stored fit: the simulator runs on it
                self.profile, self.simulator = calibrated, simulator_for(calibrated)
            logger.info(f"[2/3] simulated stage: {config.search.sim_trials} trials ({config.search.space} space)")
            sim = simulated_stage(self.simulator, config, storage, self.space, show_progress_bar=self.progress,
                                  budget=self.budget)
        self.stage = MeasuredStage(config, storage, self.simulator, self.job, self.space, self.source)
        self.earlier = EarlierJobs(self.stage)
        with self.critical():  # trials created RUNNING are held by the stage (fail_held)
            retries = self.earlier.claim_retries()
        candidates = round_candidates(self.earlier, sim, self.budget, retries, user_plan=self.user_plan,
                                      start_from=self.start_from)
        with self.critical():
            asked = retries + self.stage.ask(candidates)
            # the baseline first: every verdict compares with it
            asked.sort(key=lambda a: not a.is_baseline(self.profile, self.user_plan is not None))
            self.stage.mark_baseline(asked)
        baseline = baseline_name(self.user_plan is not None)
        logger.info(f"[3/3] measured stage: a race of {baseline} (the baseline) and {len(asked) - 1} "
                    f"candidate(s) {config.measure.protocol_text(self.confirm_launches)}; trials "
                    f"{', '.join(str(a.number) for a in asked)} (job {self.job})")
        return asked

    def _log_model(self) -> None:
        for line in model_summary(self.profile, self.simulator.run(Plan.default(self.profile)), self.simulator.params):
            logger.info(line)

    def over_budget(self, kept: list[MeasuredTrial], peak_bytes: list[int]) -> dict[int, str]:
        """Record FAIL each candidate of ``kept`` whose measured peak (``peak_bytes``, max across ranks) exceeds the
        budget; position in ``kept`` -> the reason (``planner.study.budget.fail_over_budget``)."""
        return fail_over_budget(self.stage, kept, peak_bytes, self.budget)

    def start(self, kept: list[MeasuredTrial], peak_bytes: list[int] | None = None) -> Schedule:
        """The schedule of the round's race and confirmation over ``kept`` (the baseline first).

        Args:
            peak_bytes: their measured peaks, bytes per rank (told with the times).

        Raises:
            PlannerError: the first trial is not the baseline.
        """
        if not kept or not kept[0].is_baseline(self.profile, self.user_plan is not None):
            raise PlannerError("a measured round starts with its baseline, "
                               + baseline_name(self.user_plan is not None))
        self._started = list(kept)
        self._peaks = list(peak_bytes) if peak_bytes is not None else []
        self.schedule = round_schedule(self.stage.records(), [(a.plan, a.candidate.reconfirms) for a in kept],
                                       self.config.measure, self.confirm_launches, self.cluster,
                                       None if self.on_drop is None else lambda j, n: self.on_drop(self._started[j], n))
        return self.schedule

    def tell(self, asked: list[MeasuredTrial], step_ms: list[list[float]],
             per_rank: list[list[list[float]]]) -> list[Plan]:
        """Tell each trial its race median, the survivor its confirmation; store the plans and their runs.

        Args:
            asked: the trials :meth:`start` was given, in that order.
            step_ms: per trial, every step's max across ranks (race, then confirmation), ms.
            per_rank: per trial, per rank, that rank's step times, ms.

        Returns:
            The plans with provenance filled in, in ``asked`` order.

        Raises:
            PlannerError: :meth:`start` was not called with these trials.
        """
        if self.schedule is None or [a.number for a in asked] != [a.number for a in self._started]:
            raise PlannerError("tell the trials the round was started with (TuningSession.start)")
        trials = [(a.number, a.plan, a.candidate.predicted_ms, a.candidate.predicted_peak_bytes) for a in asked]
        measured = measured_plans(self.config.name, trials, self.schedule, self._peaks,
                                  self.budget and self.budget.limit_bytes, user_baseline=self.user_plan is not None)
        self.stage.tell(asked, measured, step_ms, per_rank)
        return [m.plan for m in measured]

    def fail(self, asked: list[MeasuredTrial], reason: str, kind: FailKind) -> None:
        """Record the trials FAIL with a one-line ``reason``; ``kind`` decides whether they are measured again."""
        self.stage.fail(asked, Failure(reason, kind))

    def fail_held(self, reason: str, kind: FailKind = FailKind.INTERRUPTED) -> list[int]:
        """Record FAIL every trial the session still holds RUNNING (the job stops); the trial numbers."""
        return self.stage.fail_held(reason, kind) if self.stage is not None else []

    def finish(self, plans_measured: list[Plan], failed: dict[int, str]) -> TuneOutcome:
        """After the round: write the confirmed plan (or the baseline), calibrate on the measured plans.

        Args:
            plans_measured: what :meth:`tell` returned (empty when nothing was measured).
            failed: trial number -> why it failed.

        Raises:
            PlannerError: the plan file cannot be written.
        """
        schedule = self.schedule
        if not plans_measured or schedule is None:
            return TuneOutcome(plans_measured=plans_measured, failed=failed, profile=self.profile,
                               profile_out=self.profile_out, plan_out=self.plan_out)
        survivor = schedule.survivor
        candidate = plans_measured[survivor] if survivor is not None else None
        best = None
        if schedule.confirmation is not None or candidate is None:  # this job is decided: the study's recommendation
            best = self.earlier.recommendation()
            written = best.plan
        else:  # confirmed in fresh launches: planner.study.confirmation.conclude writes the recommendation then
            written = plans_measured[0]
        written.to_json(self.plan_out)
        calibration = calibrate(self.profile, [Observation(p, p.provenance.measured_ms) for p in plans_measured],
                                measurement_error_pct=schedule.race.median_error_pct())
        if calibration.accepted:
            self.profile = calibration.apply(self.profile)
            self.stage.save_calibration(self.profile)
        design = schedule.confirm_settings.design(schedule.race.ratio_sigma()) if candidate is not None else None
        return TuneOutcome(plans_measured=plans_measured, failed=failed, profile=self.profile,
                           profile_out=self.profile_out, race=schedule.race, candidate=candidate, written=written,
                           plan_out=self.plan_out,
                           calibration=calibration, best=best, confirmation=schedule.confirmation, design=design,
                           cluster=self.cluster)

    def save_profile(self) -> None:
        """Write the profile as it stands (calibrated once :meth:`finish` accepted a calibration) to ``profile_out``
        (raises ``PlannerError`` where it cannot)."""
        self.profile.to_json(self.profile_out)

    def close(self) -> None:
        """Stop the measured stage's heartbeat (trials still held stay RUNNING until stale: :meth:`fail_held`)."""
        if self.stage is not None:
            self.stage.close()
