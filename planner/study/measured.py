"""The measured stage (study ``NAME``): rank 0's side of a measured round.

Each trial is one plan measured on the real ranks: FSDP2's default and the
best distinct simulated plans, created with the same parameters as their
simulated trial; objective = measured step ms (median over interleaved
steps, max across ranks). ``runtime.protocol`` broadcasts the plans and
gathers the times; only rank 0 talks to the study.

Several jobs may share one study (one SQLite file or a PostgreSQL server):
each creates its own RUNNING trials, keeps them alive with a
:class:`~planner.study.heartbeat.Heartbeat`, and skips plans other jobs
measured or are measuring; a job that dies leaves stale trials that the next
job fails and re-queues (:meth:`MeasuredStage.claim_retries`).
"""

from __future__ import annotations

import math
import statistics
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import optuna

from planner.artifacts.config import StudyConfig
from planner.errors import FailKind, PlannerError
from planner.artifacts.memory_budget import mib
from planner.artifacts.plan import Plan, Source
from planner.artifacts.profile import Profile
from planner.statistics.race import Race
from planner.statistics.schedule import Schedule
from planner.simulation.parameters import simulator_for
from planner.statistics.verdict import Confirmation
from planner.storages import storage_errors
from planner.storages.archive import save_measured_plans, save_profile, update_profile
from planner.study.heartbeat import Heartbeat
from planner.study.candidates import Candidate, plan_key
from planner.study.search_space import SearchSpace
from planner.study.simulated import name_objective

METRIC = "step_ms"  # the measured study's objective: median step time in the race, ms (max across ranks)


@dataclass(frozen=True)
class MeasuredTrial:
    """A RUNNING trial of the measured study and the plan it measures.

    Attributes:
        number: the Optuna trial number.
        trial_id: the storage's trial id (heartbeats).
        plan: the plan, built from the trial's parameters for this profile.
        predicted_ms: the simulated step time, ms.
        predicted_peak_bytes: the simulated peak memory, bytes.
        retry_of: for a re-queued stale trial, the number of the trial first
            failed (Optuna's ``failed_trial`` system attribute), else ``None``.
    """

    number: int
    trial_id: int
    plan: Plan
    predicted_ms: float
    predicted_peak_bytes: int
    retry_of: int | None = None


class MeasuredStage:
    """Rank 0's side of the measured stage (study ``NAME``).

    One job's round: :meth:`claim_retries` (fail stale trials of dead jobs,
    take over their re-queued plans), :meth:`settled_keys` (plans not to
    measure again), :meth:`ask` (one RUNNING trial per candidate, heartbeat
    on), then :meth:`tell` or :meth:`fail` (:meth:`fail_held` when the job
    stops early), and :meth:`close`. Trials are created RUNNING directly in
    the storage, so concurrent jobs on one study never take each other's
    trials; Optuna numbers them.

    Raises (every method):
        StorageError: the database cannot be written (e.g. locked too long).
    """

    def __init__(self, config: StudyConfig, storage: optuna.storages.RDBStorage, profile: Profile, job: str,
                 space: SearchSpace, on_drop: Callable[[MeasuredTrial, int], None] | None = None,
                 budget_bytes: int | None = None):
        self.config = config
        self.profile = profile
        self.budget_bytes = budget_bytes
        self._peaks: list[int] = []
        self.job = job
        self.on_drop = on_drop
        self.schedule: Schedule | None = None
        self._started: list[MeasuredTrial] = []
        self.space = space
        self.storage = storage
        with self._storage_errors():
            self.study = optuna.create_study(
                study_name=config.name, storage=storage, direction="minimize", load_if_exists=True
            )
            self.study.set_user_attr("space", str(space.name))
            name_objective(self.study, METRIC)
            self.study_id = storage.get_study_id_from_name(config.name)
            self.profile_id = save_profile(storage.engine, config.name, profile)
        self.heartbeat = Heartbeat(storage, config.study.heartbeat_interval_s)

    def _storage_errors(self):
        return storage_errors(self.config.storage_url)

    def claim_retries(self) -> list[MeasuredTrial]:
        """Fail stale trials, then take over the WAITING trials that re-queue their plans.

        Stale = RUNNING with no heartbeat for ``grace_period_s`` (its job
        died). Optuna's ``fail_stale_trials`` marks them FAIL and its retry
        callback enqueues each plan again as a WAITING trial (at most
        ``max_retry`` times); a WAITING trial is claimed atomically
        (``set_trial_state_values`` to RUNNING), so one job measures it.
        """
        out = []
        simulator = simulator_for(self.profile)
        with self._storage_errors(), warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(self.study)
            for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)):
                trial_id = self.storage.get_trial_id_from_study_id_trial_number(self.study_id, t.number)
                try:
                    if not self.storage.set_trial_state_values(trial_id, optuna.trial.TrialState.RUNNING):
                        continue  # another job claimed it first
                except optuna.exceptions.UpdateFinishedTrialError:
                    continue
                self.heartbeat.add(trial_id)
                self.storage.set_trial_user_attr(trial_id, "job", self.job)
                try:
                    plan = self.space.suggest(optuna.trial.FixedTrial(t.params), self.profile)
                    result = simulator.run(plan)
                except (PlannerError, KeyError, ValueError) as e:
                    self._fail_one(t.number, trial_id, f"cannot rebuild the plan: {e}", FailKind.ERROR)
                    continue
                retry_of = t.system_attrs.get("failed_trial")
                out.append(MeasuredTrial(t.number, trial_id, plan, result.step_ms, result.peak_bytes, retry_of))
        return out

    def settled_keys(self) -> set[str]:
        """:func:`~planner.study.simulated.plan_key` of plans not to measure again in this study.

        Measured (COMPLETE), being measured by another job (RUNNING), or
        failed on a rank (FAIL with ``fail_kind`` :attr:`FailKind.ERROR`).
        Plans whose trial was interrupted or went stale are measured again.
        """
        with self._storage_errors():
            trials = self.study.get_trials(deepcopy=False)
        keys = set()
        for t in trials:
            key = t.user_attrs.get("plan_key")
            state = t.state
            if key and (state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING)
                        or (state == optuna.trial.TrialState.FAIL and t.user_attrs.get("fail_kind") == FailKind.ERROR)):
                keys.add(key)
        return keys

    def ask(self, candidates: list[Candidate]) -> list[MeasuredTrial]:
        """Create one RUNNING trial per candidate, with its parameters and prediction."""
        out = []
        with self._storage_errors():
            for c in candidates:
                template = optuna.trial.create_trial(
                    state=optuna.trial.TrialState.RUNNING, params=c.params, distributions=c.distributions,
                    user_attrs={
                        "predicted_ms": c.predicted_ms, "predicted_peak_bytes": c.predicted_peak_bytes,
                        "is_default": c.plan.is_default_for(self.profile), "plan_key": plan_key(c.plan),
                        "job": self.job,
                    },
                )
                trial_id = self.storage.create_new_trial(self.study_id, template_trial=template)
                self.heartbeat.add(trial_id)
                number = self.storage.get_trial_number_from_id(trial_id)
                out.append(MeasuredTrial(number, trial_id, c.plan, c.predicted_ms, c.predicted_peak_bytes))
        return out

    def over_budget(self, kept: list[MeasuredTrial], peak_bytes: list[int]) -> dict[int, str]:
        """Record FAIL (``FailKind.ERROR``: not measured again) each candidate whose measured peak exceeds the budget.

        ``kept``: the round's trials, FSDP2's default first; ``peak_bytes``: their measured peaks, bytes per rank.

        Returns:
            Position in ``kept`` -> the reason recorded. FSDP2's default, the baseline, is never
            failed (a budget below every predicted peak is refused earlier: ``check_feasible``).
        """
        out: dict[int, str] = {}
        if self.budget_bytes is None:
            return out
        with self._storage_errors():
            for j, (a, peak) in enumerate(zip(kept, peak_bytes)):
                if j == 0 or peak <= self.budget_bytes:
                    continue
                reason = (f"measured peak {mib(peak)} exceeds the memory budget {mib(self.budget_bytes)} "
                          f"(predicted {mib(a.predicted_peak_bytes)})")
                self.storage.set_trial_user_attr(a.trial_id, "measured_peak_bytes", peak)
                self._fail_one(a.number, a.trial_id, reason, FailKind.ERROR)
                out[j] = reason
        return out

    def start(self, kept: list[MeasuredTrial], peak_bytes: list[int] | None = None) -> Schedule:
        """The schedule of the round's race and confirmation over ``kept`` (FSDP2's default first).

        ``peak_bytes``: their measured peaks, bytes per rank (told with the times).
        Raises:
            PlannerError: the first trial is not FSDP2's default.
        """
        if not kept or not kept[0].plan.is_default_for(self.profile):
            raise PlannerError("a measured round starts with FSDP2's default plan, its baseline")
        self._started = list(kept)
        self._peaks = list(peak_bytes) if peak_bytes is not None else []
        on_drop = None
        if self.on_drop is not None:
            on_drop = lambda plan, rounds: self.on_drop(self._started[plan], rounds)  # noqa: E731
        measure = self.config.measure
        self.schedule = Schedule(len(kept), measure.race_settings(), measure.confirm_settings(self.config.search.seed),
                                 on_drop=on_drop)
        return self.schedule

    def tell(
        self,
        asked: list[MeasuredTrial],
        step_ms: list[list[float]],
        per_rank: list[list[list[float]]],
    ) -> list[Plan]:
        """Tell each trial its race median (max across ranks), with the confirmation on the survivor; store plans and runs.

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
            raise PlannerError("tell the trials the round was started with (MeasuredStage.start)")
        race, survivor, confirmation = self.schedule.race, self.schedule.survivor, self.schedule.confirmation
        default_ms = statistics.median(race.step_ms(0))
        plans, attrs = [], []
        for j, a in enumerate(asked):
            figures = _trial_figures(j, race, survivor, confirmation)
            if j < len(self._peaks):
                figures["measured_peak_bytes"] = self._peaks[j]
            attrs.append(figures)
            confirmed = {k: figures[k] for k in ("verdict", "measured_ratio", "rounds", "noise_pct") if k in figures}
            if "ratio_ci95" in figures:
                confirmed["ratio_ci95"] = tuple(figures["ratio_ci95"])
            plans.append(a.plan.with_provenance(
                source=Source.MEASURED, study=self.config.name, trial=a.number, predicted_ms=a.predicted_ms,
                measured_ms=statistics.median(race.step_ms(j)), default_measured_ms=default_ms,
                predicted_peak_bytes=a.predicted_peak_bytes, measured_peak_bytes=figures.get("measured_peak_bytes"),
                memory_budget_bytes=self.budget_bytes, **confirmed))
        with self._storage_errors():
            # Our rows first, then Optuna's state: a reader that sees a COMPLETE trial finds its plan.
            save_measured_plans(self.storage.engine, self.config.name, self.profile_id, plans,
                                [p.is_default_for(self.profile) for p in plans], step_ms, per_rank)
            for a, plan, times, ranks, figures in zip(asked, plans, step_ms, per_rank, attrs):
                self.storage.set_trial_user_attr(a.trial_id, "step_ms", times)
                self.storage.set_trial_user_attr(a.trial_id, "per_rank_step_ms", ranks)
                for key, value in figures.items():
                    self.storage.set_trial_user_attr(a.trial_id, key, value)
                self.study.tell(a.number, plan.provenance.measured_ms, skip_if_finished=True)  # a stale FAIL stays
                self.heartbeat.discard(a.trial_id)
        return plans

    def fail(self, asked: list[MeasuredTrial], reason: str, kind: FailKind) -> None:
        """Record every still-RUNNING trial of ``asked`` as FAIL.

        Args:
            reason: one line, stored as user attribute ``fail_reason``.
            kind: stored as user attribute ``fail_kind``; decides whether the
                plan is measured again (:class:`~planner.errors.FailKind`).
        """
        with self._storage_errors():
            for a in asked:
                self._fail_one(a.number, a.trial_id, reason, kind)

    def fail_held(self, reason: str, kind: FailKind = FailKind.INTERRUPTED) -> list[int]:
        """Record as FAIL every trial this stage still holds RUNNING (claimed or asked, not yet told).

        The last word of a job that stops for any reason (an interrupt that
        came before the round's trials were handed out, a storage error):
        none of its trials is left RUNNING for the next job to wait out.

        Returns:
            The trial numbers failed.
        """
        numbers = []
        with self._storage_errors():
            for trial_id in self.heartbeat.held():
                number = self.storage.get_trial_number_from_id(trial_id)
                if self._fail_one(number, trial_id, reason, kind):
                    numbers.append(number)
        return numbers

    def _fail_one(self, number: int, trial_id: int, reason: str, kind: FailKind) -> bool:
        """FAIL the trial if it is still RUNNING; whether it was."""
        self.heartbeat.discard(trial_id)
        if self.storage.get_trial(trial_id).state != optuna.trial.TrialState.RUNNING:
            return False
        self.storage.set_trial_user_attr(trial_id, "fail_reason", reason)
        self.storage.set_trial_user_attr(trial_id, "fail_kind", str(kind))
        self.study.tell(number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        return True

    def save_calibration(self, profile: Profile) -> None:
        """Store the calibrated profile in this run's profile row."""
        with self._storage_errors():
            update_profile(self.storage.engine, self.profile_id, profile)

    def close(self) -> None:
        """Stop the heartbeat thread (trials still held stay RUNNING until stale: see :meth:`fail_held`)."""
        self.heartbeat.stop()


def _trial_figures(j: int, race: Race, survivor: int | None, confirmation: Confirmation | None) -> dict[str, Any]:
    """Plan ``j``'s figures from the round, as trial user attributes (JSON values)."""
    figures: dict[str, Any] = {"race_rounds": len(race.step_ms(j))}
    if math.isfinite(race.noise_pct()):
        figures["race_noise_pct"] = race.noise_pct()
    if j != race.default:
        figures["race_ratio"] = math.exp(statistics.median(race.log_ratios(j, race.default)))
    if j in race.dropped:
        figures["dropped_after_round"] = race.dropped[j]
    if j == survivor and confirmation is not None:
        figures.update(verdict=str(confirmation.verdict), measured_ratio=confirmation.ratio,
                       ratio_ci95=list(confirmation.ci95), rounds=confirmation.rounds,
                       noise_pct=confirmation.noise_pct)
    return figures
