"""The Optuna study driver: simulated stage, measured stage, queries.

Two Optuna studies share the storage:

- ``NAME.sim``: the simulated stage; objective = predicted step ms. FSDP2's
  default and the uniform grid are enqueued first, then the sampler (TPE)
  explores. Thousands of trials per minute.
- ``NAME``: the measured stage; objective = measured step ms (median over
  interleaved steps, max across ranks). Each trial is one plan: FSDP2's
  default and the best distinct simulated plans, enqueued with the same
  parameters as their simulated trial.

Only rank 0 talks to the study; ``runtime.protocol`` broadcasts the plans and
gathers the times. Several jobs may share one study (one SQLite file or a
PostgreSQL server): each creates its own RUNNING trials, keeps them alive with
Optuna's heartbeat, and skips plans other jobs measured or are measuring; a
job that dies leaves stale trials that the next job fails and re-queues
(:meth:`MeasuredStage.claim_retries`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import statistics
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import optuna
import sqlalchemy as sa

from planner.config import StudyConfig
from planner.errors import PlannerError, StorageError, StudyNotFoundError
from planner.plan import Plan
from planner.profile import Profile
from planner.simulator import SimParams, simulate
from planner.storage import (
    MeasuredRunRow,
    PlanRow,
    ProfileRow,
    check_exists,
    create_racing,
    describe_storage_error,
    engine_for,
    engine_kwargs,
    session,
)

SIM_SUFFIX = ".sim"


def open_storage(url: str, config: StudyConfig | None = None) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage at ``url`` (creating its tables).

    SQLite files are switched to write-ahead logging with
    ``synchronous=NORMAL``: commits cost less (copying 2000 simulated trials
    drops from about 21 s to 12 s) and readers do not block the writer; a
    writer waits up to :func:`planner.storage.sqlite_timeout_s` for another's
    lock. With ``config``, Optuna's heartbeat is on
    (``config.heartbeat_interval_s``, ``config.grace_period_s``) and a stale
    trial's plan is re-queued up to ``config.max_retry`` times
    (``RetryFailedTrialCallback``).

    Raises:
        StorageError: the URL cannot be opened (the message says why).
    """
    try:
        with warnings.catch_warnings():  # the heartbeat and its callback are "experimental" since Optuna 2.8
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            heartbeat: dict[str, Any] = {}
            if config is not None:
                heartbeat = {
                    "heartbeat_interval": config.heartbeat_interval_s,
                    "grace_period": config.grace_period_s,
                    _STALE_CALLBACK_ARG: _RetryCallback(max_retry=config.max_retry),
                }
            storage = create_racing(
                lambda: optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs(url), **heartbeat)
            )
        if storage.engine.dialect.name == "sqlite":
            sa.event.listen(storage.engine, "connect", _sqlite_pragmas)
            storage.engine.dispose()  # reconnect with the pragmas
        return storage
    except Exception as e:  # noqa: BLE001 - SQLAlchemy/driver errors of every kind
        raise StorageError(describe_storage_error(url, e)) from None


# Optuna 5 renamed the stale-trial callback; 4.x has only the old name.
if hasattr(optuna.storages, "RetryHeartbeatStaleTrialCallback"):
    _RetryCallback = optuna.storages.RetryHeartbeatStaleTrialCallback
    _STALE_CALLBACK_ARG = "heartbeat_stale_trial_callback"
else:  # pragma: no cover - Optuna 4.x
    _RetryCallback = optuna.storages.RetryFailedTrialCallback
    _STALE_CALLBACK_ARG = "failed_trial_callback"


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


SAMPLERS = {
    "tpe": lambda seed: optuna.samplers.TPESampler(seed=seed),
    "nsga2": lambda seed: optuna.samplers.NSGAIISampler(seed=seed),
    "random": lambda seed: optuna.samplers.RandomSampler(seed=seed),
}


@dataclass(frozen=True)
class Candidate:
    """A plan chosen for the measured stage, with its simulated trial's parameters."""

    params: dict[str, Any]
    distributions: dict[str, optuna.distributions.BaseDistribution]
    plan: Plan
    predicted_ms: float
    predicted_peak_bytes: int


def plan_key(plan: Plan) -> str:
    """A short digest of :meth:`Plan.behaviour_key`, stored as trial attribute ``plan_key``."""
    return hashlib.sha1(plan.behaviour_key().encode()).hexdigest()[:16]


def simulated_stage(
    profile: Profile,
    config: StudyConfig,
    storage: optuna.storages.BaseStorage,
    params: SimParams | None = None,
    show_progress_bar: bool = True,
) -> optuna.Study:
    """Run ``config.sim_trials`` simulated trials and store them in study ``NAME.sim``.

    The trials run in an in-memory Optuna study (an RDB storage costs tens of
    ms per trial, the simulator tens of µs), warm-started with the trials
    ``NAME.sim`` already holds; the new trials are then added to ``NAME.sim``
    in one pass. On a new study FSDP2's default and the search space's grid
    are enqueued first. A trial whose plan cannot be simulated is recorded as
    FAIL and the study goes on.

    Returns:
        The in-memory study (stored and new trials).
    """
    from search_spaces import get_space

    space = get_space(config.space)
    stored = optuna.create_study(
        study_name=config.name + SIM_SUFFIX, storage=storage, direction="minimize", load_if_exists=True
    )
    stored.set_user_attr("space", config.space)
    previous = [t for t in stored.trials if t.state.is_finished()]
    study = optuna.create_study(direction="minimize", sampler=SAMPLERS[config.sampler](config.seed + len(previous)))
    study.add_trials(previous)
    if not previous:
        for p in space.grid(profile):
            study.enqueue_trial(p)

    def objective(trial: optuna.Trial) -> float:
        plan = space.suggest(trial, profile)
        result = simulate(profile, plan, params)
        trial.set_user_attr("peak_bytes", result.peak_bytes)
        trial.set_user_attr("exposed_comm_ms", result.exposed_comm_ms)
        return result.step_ms

    study.optimize(
        objective, n_trials=config.sim_trials, show_progress_bar=show_progress_bar,
        catch=(PlannerError, KeyError, ValueError),
    )
    stored.add_trials(study.trials[len(previous):])
    return study


def select_candidates(
    sim_study: optuna.Study, profile: Profile, space_name: str, k: int, exclude: frozenset[str] | set[str] = frozenset()
) -> list[Candidate]:
    """FSDP2's default followed by the ``k`` best distinct simulated plans.

    Plans are distinct by behaviour (:meth:`Plan.behaviour_key`), so two
    parameter sets giving one plan are measured once. Plans whose
    :func:`plan_key` is in ``exclude`` (measured already, being measured by
    another job, or failed on a rank) are skipped; the default never is: it
    is every job's baseline.
    """
    from search_spaces import get_space

    space = get_space(space_name)
    default_params = space.grid(profile)[0]
    seen: set[str] = set()
    out: list[Candidate] = []
    done = _complete(sim_study)
    default_trial = next((t for t in done if t.params == default_params), None)
    ranked = ([default_trial] if default_trial else []) + sorted(done, key=lambda t: (t.value, t.number))
    for t in ranked:
        plan = space.suggest(optuna.trial.FixedTrial(t.params), profile)
        key = plan.behaviour_key()
        if key in seen or (out and plan_key(plan) in exclude):
            continue
        seen.add(key)
        out.append(Candidate(t.params, t.distributions, plan, t.value, t.user_attrs.get("peak_bytes", 0)))
        if len(out) == k + 1:
            break
    return out


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


class _Heartbeat:
    """Records Optuna heartbeats of RUNNING trials from a daemon thread.

    ``study.optimize`` runs such a thread for its one trial; the measured
    stage holds several trials RUNNING at once through ask-and-tell, so it
    keeps its own, calling ``RDBStorage.record_heartbeat`` for each.
    """

    def __init__(self, storage: optuna.storages.RDBStorage, interval_s: float):
        self.storage = storage
        self.interval_s = interval_s
        self.ids: set[int] = set()
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="prefetch-planner-heartbeat", daemon=True)
        self.thread.start()

    def add(self, trial_id: int) -> None:
        with self.lock:  # held before the first beat, so an interrupt here still finds it (``fail_held``)
            self.ids.add(trial_id)
        self.storage.record_heartbeat(trial_id)

    def held(self) -> list[int]:
        with self.lock:
            return sorted(self.ids)

    def discard(self, trial_id: int) -> None:
        with self.lock:
            self.ids.discard(trial_id)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)

    def _run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            with self.lock:
                ids = sorted(self.ids)
            for trial_id in ids:
                try:
                    self.storage.record_heartbeat(trial_id)
                except Exception:  # noqa: BLE001 - a missed beat is retried next interval
                    pass


class MeasuredStage:
    """Rank 0's side of the measured stage (study ``NAME``).

    One job's round: :meth:`claim_retries` (fail stale trials of dead jobs,
    take over their re-queued plans), :meth:`settled_keys` (plans not to
    measure again), :meth:`ask` (one RUNNING trial per candidate, heartbeat
    on), then :meth:`tell` or :meth:`fail` (:meth:`fail_held` when the job
    stops early), and :meth:`close`. Trials are
    created RUNNING directly in the storage, so concurrent jobs on one study
    never take each other's trials; Optuna numbers them.

    Raises (every method):
        StorageError: the database cannot be written (e.g. locked too long).
    """

    def __init__(self, config: StudyConfig, storage: optuna.storages.RDBStorage, profile: Profile, job: str):
        from search_spaces import get_space

        self.config = config
        self.profile = profile
        self.job = job
        self.space = get_space(config.space)
        self.storage = storage
        with self._storage_errors():
            self.study = optuna.create_study(
                study_name=config.name, storage=storage, direction="minimize", load_if_exists=True
            )
            self.study.set_user_attr("space", config.space)
            self.study_id = storage.get_study_id_from_name(config.name)
            self.engine = engine_for(config.storage)
            with session(self.engine) as s:
                row = ProfileRow(study_name=config.name, measured_step_ms=profile.measured_step_ms,
                                 json=profile.to_json())
                s.add(row)
                s.commit()
                self.profile_id = row.id
        self.heartbeat = _Heartbeat(storage, config.heartbeat_interval_s)

    def _storage_errors(self) -> contextlib.AbstractContextManager[None]:
        return _storage_errors(self.config.storage)

    def claim_retries(self) -> list[MeasuredTrial]:
        """Fail stale trials, then take over the WAITING trials that re-queue their plans.

        Stale = RUNNING with no heartbeat for ``grace_period_s`` (its job
        died). Optuna's ``fail_stale_trials`` marks them FAIL and its retry
        callback enqueues each plan again as a WAITING trial (at most
        ``max_retry`` times); a WAITING trial is claimed atomically
        (``set_trial_state_values`` to RUNNING), so one job measures it.
        """
        out = []
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
                    result = simulate(self.profile, plan)
                except (PlannerError, KeyError, ValueError) as e:
                    self._fail_one(t.number, trial_id, f"cannot rebuild the plan: {e}", "error")
                    continue
                retry_of = t.system_attrs.get("failed_trial")
                out.append(MeasuredTrial(t.number, trial_id, plan, result.step_ms, result.peak_bytes, retry_of))
        return out

    def settled_keys(self) -> set[str]:
        """:func:`plan_key` of plans not to measure again in this study.

        Measured (COMPLETE), being measured by another job (RUNNING), or
        failed on a rank (FAIL with ``fail_kind`` ``"error"``). Plans whose
        trial was interrupted or went stale are measured again.
        """
        with self._storage_errors():
            trials = self.study.get_trials(deepcopy=False)
        keys = set()
        for t in trials:
            key = t.user_attrs.get("plan_key")
            state = t.state
            if key and (state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING)
                        or (state == optuna.trial.TrialState.FAIL and t.user_attrs.get("fail_kind") == "error")):
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

    def tell(
        self,
        asked: list[MeasuredTrial],
        step_ms: list[list[float]],
        per_rank: list[list[list[float]]],
    ) -> list[Plan]:
        """Tell each trial its median step ms (max across ranks) and store plans and runs.

        Args:
            asked: the trials, in measurement order.
            step_ms: per trial, the per-step max across ranks, ms.
            per_rank: per trial, per rank, that rank's step times, ms.

        Returns:
            The plans with provenance filled in, in ``asked`` order.
        """
        medians = [statistics.median(ms) for ms in step_ms]
        default_ms = next((m for a, m in zip(asked, medians) if a.plan.is_default_for(self.profile)), None)
        plans = [
            a.plan.with_provenance(source="measured", study=self.config.name, trial=a.number,
                                   predicted_ms=a.predicted_ms, measured_ms=ms, default_measured_ms=default_ms)
            for a, ms in zip(asked, medians)
        ]
        with self._storage_errors():
            # Our rows first, then Optuna's state: a reader that sees a COMPLETE trial finds its plan.
            with session(self.engine) as s:
                for plan, a, times, ranks in zip(plans, asked, step_ms, per_rank):
                    row = PlanRow(
                        study_name=self.config.name, trial_number=a.number, profile_id=self.profile_id,
                        is_default=plan.is_default_for(self.profile), predicted_ms=a.predicted_ms,
                        measured_ms=plan.provenance.measured_ms, predicted_peak_bytes=a.predicted_peak_bytes,
                        json=plan.to_json(),
                    )
                    s.add(row)
                    s.flush()
                    s.add(MeasuredRunRow(
                        plan_id=row.id, study_name=self.config.name,
                        step_ms_json=json.dumps(times), per_rank_json=json.dumps(ranks),
                    ))
                s.commit()
            for a, ms, times, ranks in zip(asked, medians, step_ms, per_rank):
                self.storage.set_trial_user_attr(a.trial_id, "step_ms", times)
                self.storage.set_trial_user_attr(a.trial_id, "per_rank_step_ms", ranks)
                self.study.tell(a.number, ms, skip_if_finished=True)  # a trial failed as stale stays FAIL
                self.heartbeat.discard(a.trial_id)
        return plans

    def fail(self, asked: list[MeasuredTrial], reason: str, kind: str) -> None:
        """Record every still-RUNNING trial of ``asked`` as FAIL.

        Args:
            reason: one line, stored as user attribute ``fail_reason``.
            kind: ``"error"`` (a rank raised; the plan is not tried again) or
                ``"interrupted"`` (Ctrl-C, SIGTERM; the next job measures it).
        """
        with self._storage_errors():
            for a in asked:
                self._fail_one(a.number, a.trial_id, reason, kind)

    def fail_held(self, reason: str, kind: str = "interrupted") -> list[int]:
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

    def _fail_one(self, number: int, trial_id: int, reason: str, kind: str) -> bool:
        """FAIL the trial if it is still RUNNING; whether it was."""
        self.heartbeat.discard(trial_id)
        if self.storage.get_trial(trial_id).state != optuna.trial.TrialState.RUNNING:
            return False
        self.storage.set_trial_user_attr(trial_id, "fail_reason", reason)
        self.storage.set_trial_user_attr(trial_id, "fail_kind", kind)
        self.study.tell(number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        return True

    def save_calibration(self, profile: Profile) -> None:
        """Store the calibrated profile in this run's profile row."""
        with self._storage_errors(), session(self.engine) as s:
            row = s.get(ProfileRow, self.profile_id)
            row.json = profile.to_json()
            s.commit()

    def close(self) -> None:
        """Stop the heartbeat thread (trials still held stay RUNNING until stale: see :meth:`fail_held`)."""
        self.heartbeat.stop()


@contextlib.contextmanager
def _storage_errors(url: str) -> Iterator[None]:
    """Database errors inside become one-line :class:`StorageError`."""
    try:
        yield
    except sa.exc.SQLAlchemyError as e:
        raise StorageError(describe_storage_error(url, e)) from None


# -- queries -----------------------------------------------------------------


def latest_calibration(url: str, name: str, profile: Profile) -> dict[str, float] | None:
    """The newest calibration stored for study ``name`` on the same model and world, if any."""
    with session(engine_for(url)) as s:
        rows = s.scalars(
            sa.select(ProfileRow).where(ProfileRow.study_name == name).order_by(ProfileRow.id.desc())
        ).all()
    for row in rows:
        try:
            stored = Profile.from_json(row.json)
        except PlannerError:
            continue
        if stored.calibration and stored.fingerprint.first_difference(profile.fingerprint) is None:
            return stored.calibration
    return None


@dataclass(frozen=True)
class StudySummary:
    """One measured study: name, trial counts, best and default measured ms."""

    name: str
    measured_trials: int
    simulated_trials: int
    best_ms: float | None
    default_ms: float | None


def _load(url: str, name: str) -> tuple[optuna.Study, optuna.storages.BaseStorage]:
    check_exists(url)
    storage = open_storage(url)
    try:
        return optuna.load_study(study_name=name, storage=storage), storage
    except KeyError:
        names = sorted(n for n in optuna.get_all_study_names(storage) if not n.endswith(SIM_SUFFIX))
        raise StudyNotFoundError(
            f"no study {name!r} in {url}; studies there: {', '.join(names) or 'none'}"
        ) from None


def _complete(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))


def list_studies(url: str) -> list[StudySummary]:
    """Every measured study in the storage at ``url``.

    Raises:
        StudyNotFoundError: a SQLite file that does not exist.
        StorageError: the storage cannot be opened.
    """
    check_exists(url)
    storage = open_storage(url)
    names = optuna.get_all_study_names(storage)
    out = []
    for name in sorted(n for n in names if not n.endswith(SIM_SUFFIX)):
        study = optuna.load_study(study_name=name, storage=storage)
        done = _complete(study)
        sim_count = 0
        if name + SIM_SUFFIX in names:
            sim_count = len(optuna.load_study(study_name=name + SIM_SUFFIX, storage=storage).trials)
        defaults = [t.value for t in done if t.user_attrs.get("is_default")]
        out.append(StudySummary(
            name, len(study.trials), sim_count,
            min((t.value for t in done), default=None), defaults[-1] if defaults else None,
        ))
    return out


def study_trials(url: str, name: str) -> list[dict[str, Any]]:
    """Trials of study ``name``: measured ones, then simulated ones.

    Each row: ``stage``, ``number``, ``state``, ``predicted_ms``,
    ``measured_ms``, ``is_default``, ``params``; measured rows also ``job``,
    ``fail_reason`` and ``retry_of`` (the stale trial a retry re-measures).

    Raises:
        StudyNotFoundError: no such study.
    """
    study, storage = _load(url, name)
    rows = [
        {
            "stage": "measured", "number": t.number, "state": t.state.name,
            "predicted_ms": t.user_attrs.get("predicted_ms"), "measured_ms": t.value,
            "is_default": bool(t.user_attrs.get("is_default")), "params": t.params,
            "job": t.user_attrs.get("job"), "fail_reason": t.user_attrs.get("fail_reason"),
            "retry_of": t.system_attrs.get("failed_trial"),
        }
        for t in study.trials
    ]
    try:
        sim = optuna.load_study(study_name=name + SIM_SUFFIX, storage=storage)
    except KeyError:
        sim = None
    for t in sim.trials if sim else []:
        rows.append({
            "stage": "simulated", "number": t.number, "state": t.state.name,
            "predicted_ms": t.value, "measured_ms": None, "is_default": None, "params": t.params,
        })
    return rows


def best_plan(url: str, name: str) -> tuple[Plan, float | None]:
    """The best measured plan of study ``name`` and the default's measured ms.

    Raises:
        StudyNotFoundError: no such study, or no measured plan in it yet.
    """
    study, _ = _load(url, name)
    done = _complete(study)
    if not done:
        raise StudyNotFoundError(f"study {name!r} has no measured trial yet; run `prefetch-planner tune` on it")
    best = min(done, key=lambda t: (t.value, t.number))
    defaults = [t.value for t in done if t.user_attrs.get("is_default")]
    engine = engine_for(url)
    with session(engine) as s:
        row = s.scalars(
            sa.select(PlanRow).where(PlanRow.study_name == name, PlanRow.trial_number == best.number)
            .order_by(PlanRow.id.desc())
        ).first()
    if row is None:
        raise StudyNotFoundError(f"study {name!r} trial {best.number} has no stored plan")
    return Plan.from_json(row.json), (defaults[-1] if defaults else None)


