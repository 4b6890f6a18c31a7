"""The Optuna study driver: simulated stage, measured stage, queries.

Two Optuna studies share the storage:

- ``NAME.sim``: the simulated stage; objective = predicted step ms. FSDP2's
  default and the uniform grid are enqueued first, then the sampler (TPE)
  explores. Thousands of trials per minute.
- ``NAME``: the measured stage; objective = measured step ms (median over
  interleaved steps, max across ranks). Each trial is one plan: FSDP2's
  default and the best distinct simulated plans, enqueued with the same
  parameters as their simulated trial.

Only rank 0 talks to the study; ``runtime.launch.tune_rank`` broadcasts the
plans and gathers the times.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Any

import optuna
import sqlalchemy as sa

from planner.config import StudyConfig
from planner.errors import PlannerError, StorageError, StudyNotFoundError
from planner.plan import Plan
from planner.profile import Profile
from planner.simulator import SimParams, simulate
from planner.storage import MeasuredRunRow, PlanRow, ProfileRow, check_exists, engine_for, session

SIM_SUFFIX = ".sim"


def open_storage(url: str) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage at ``url`` (creating its tables).

    SQLite files are switched to write-ahead logging with
    ``synchronous=NORMAL``: commits cost less (copying 2000 simulated trials
    drops from about 21 s to 12 s) and readers do not block the writer.

    Raises:
        StorageError: the URL cannot be opened.
    """
    try:
        storage = optuna.storages.RDBStorage(url)
        if storage.engine.dialect.name == "sqlite":
            sa.event.listen(storage.engine, "connect", _sqlite_pragmas)
            storage.engine.dispose()  # reconnect with the pragmas
        return storage
    except Exception as e:  # noqa: BLE001 - SQLAlchemy/driver errors of every kind
        raise StorageError(f"cannot open storage {url!r}: {str(e).splitlines()[0]}") from None


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
    """A plan chosen for the measured stage."""

    params: dict[str, Any]
    plan: Plan
    predicted_ms: float
    predicted_peak_bytes: int


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


def select_candidates(sim_study: optuna.Study, profile: Profile, space_name: str, k: int) -> list[Candidate]:
    """FSDP2's default followed by the ``k`` best distinct simulated plans.

    Plans are distinct by behaviour (:meth:`Plan.behaviour_key`), so two
    parameter sets giving one plan are measured once.
    """
    from search_spaces import get_space

    space = get_space(space_name)
    default_params = space.grid(profile)[0]
    seen: set[str] = set()
    out: list[Candidate] = []
    done = _complete(sim_study)
    default_trial = next((t for t in done if t.params == default_params), None)
    ranked = ([default_trial] if default_trial else []) + sorted(done, key=lambda t: t.value)
    for t in ranked:
        plan = space.suggest(optuna.trial.FixedTrial(t.params), profile)
        key = plan.behaviour_key()
        if key in seen:
            continue
        seen.add(key)
        out.append(Candidate(t.params, plan, t.value, t.user_attrs.get("peak_bytes", 0)))
        if len(out) == k + 1:
            break
    return out


class MeasuredStage:
    """Rank 0's side of the measured stage: ask trials, tell results, store rows."""

    def __init__(self, config: StudyConfig, storage: optuna.storages.BaseStorage, profile: Profile):
        from search_spaces import get_space

        self.config = config
        self.profile = profile
        self.space = get_space(config.space)
        self.study = optuna.create_study(
            study_name=config.name, storage=storage, direction="minimize", load_if_exists=True
        )
        self.study.set_user_attr("space", config.space)
        self.engine = engine_for(config.storage)
        with session(self.engine) as s:
            row = ProfileRow(study_name=config.name, measured_step_ms=profile.measured_step_ms, json=profile.to_json())
            s.add(row)
            s.commit()
            self.profile_id = row.id

    def ask(self, candidates: list[Candidate]) -> list[tuple[optuna.Trial, Plan, Candidate]]:
        """Create one RUNNING trial per candidate with the candidate's parameters."""
        out = []
        for c in candidates:
            self.study.enqueue_trial(c.params, skip_if_exists=False)
            trial = self.study.ask()
            plan = self.space.suggest(trial, self.profile)
            trial.set_user_attr("predicted_ms", c.predicted_ms)
            trial.set_user_attr("predicted_peak_bytes", c.predicted_peak_bytes)
            trial.set_user_attr("is_default", plan.is_default_for(self.profile))
            out.append((trial, plan, c))
        return out

    def tell(
        self,
        asked: list[tuple[optuna.Trial, Plan, Candidate]],
        step_ms: list[list[float]],
        per_rank: list[list[list[float]]],
    ) -> list[Plan]:
        """Tell each trial its median step ms and store plans and runs.

        Returns:
            The plans with provenance filled in, in ``asked`` order.
        """
        medians = [statistics.median(ms) for ms in step_ms]
        default_ms = next((m for (t, p, c), m in zip(asked, medians) if p.is_default_for(self.profile)), None)
        plans = []
        for (trial, plan, c), ms, times in zip(asked, medians, step_ms):
            trial.set_user_attr("step_ms", times)
            self.study.tell(trial, ms)
            plans.append(plan.with_provenance(
                source="measured", study=self.config.name, trial=trial.number,
                predicted_ms=c.predicted_ms, measured_ms=ms, default_measured_ms=default_ms,
            ))
        # Our rows after Optuna's writes: one SQLite writer at a time.
        with session(self.engine) as s:
            for plan, (_, _, c), times, ranks in zip(plans, asked, step_ms, per_rank):
                row = PlanRow(
                    study_name=self.config.name, trial_number=plan.provenance.trial, profile_id=self.profile_id,
                    is_default=plan.is_default_for(self.profile), predicted_ms=c.predicted_ms,
                    measured_ms=plan.provenance.measured_ms, predicted_peak_bytes=c.predicted_peak_bytes,
                    json=plan.to_json(),
                )
                s.add(row)
                s.flush()
                s.add(MeasuredRunRow(
                    plan_id=row.id, study_name=self.config.name,
                    step_ms_json=json.dumps(times), per_rank_json=json.dumps(ranks),
                ))
            s.commit()
        return plans

    def save_calibration(self, profile: Profile) -> None:
        """Store the calibrated profile in this run's profile row."""
        with session(self.engine) as s:
            row = s.get(ProfileRow, self.profile_id)
            row.json = profile.to_json()
            s.commit()

    def fail(self, asked: list[tuple[optuna.Trial, Plan, Candidate]], reason: str) -> None:
        """Record every asked trial as FAIL with ``reason``."""
        for trial, _, _ in asked:
            trial.set_user_attr("fail_reason", reason)
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)


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
    ``measured_ms``, ``is_default``, ``params``.

    Raises:
        StudyNotFoundError: no such study.
    """
    study, storage = _load(url, name)
    rows = [
        {
            "stage": "measured", "number": t.number, "state": t.state.name,
            "predicted_ms": t.user_attrs.get("predicted_ms"), "measured_ms": t.value,
            "is_default": bool(t.user_attrs.get("is_default")), "params": t.params,
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
    best = min(done, key=lambda t: t.value)
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


