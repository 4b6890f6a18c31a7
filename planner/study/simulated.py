"""The simulated stage (study ``NAME.sim``) and the choice of candidates for the measured stage."""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass
from typing import Any

import optuna

from planner.config import StudyConfig
from planner.errors import PlannerError
from planner.plan import Plan
from planner.profile import Profile
from planner.samplers import make_sampler
from planner.simulator import SimParams, simulate
from search_spaces import get_space

SIM_SUFFIX = ".sim"
SIM_METRIC = "predicted_step_ms"  # the simulated study's objective, ms


@dataclass(frozen=True)
class Candidate:
    """A plan chosen for the measured stage, with its simulated trial's parameters.

    Attributes:
        params, distributions: the simulated trial's, so the measured trial
            carries the same parameters (optuna-dashboard compares them).
        plan: the plan they build for the profile.
        predicted_ms: the simulated step time, ms.
        predicted_peak_bytes: the simulated peak memory, bytes.
    """

    params: dict[str, Any]
    distributions: dict[str, optuna.distributions.BaseDistribution]
    plan: Plan
    predicted_ms: float
    predicted_peak_bytes: int


def name_objective(study: optuna.Study, name: str) -> None:
    """``study.set_metric_names([name])`` (optuna-dashboard shows it), without its "experimental" warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names([name])


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
    """Run ``[search] sim_trials`` simulated trials and store them in study ``NAME.sim``.

    The trials run in an in-memory Optuna study (an RDB storage costs tens of
    ms per trial, the simulator tens of µs), warm-started with the trials
    ``NAME.sim`` already holds; the new trials are then added to ``NAME.sim``
    in one pass. On a new study FSDP2's default and the search space's grid
    are enqueued first. A trial whose plan cannot be simulated is recorded as
    FAIL and the study goes on.

    Args:
        profile: the profile to simulate on (its calibration, if any, is used).
        config: the study (``[search]`` table).
        storage: where ``NAME.sim`` lives.
        params: simulator parameters instead of the profile's calibration.
        show_progress_bar: Optuna's progress bar.

    Returns:
        The in-memory study (stored and new trials).
    """
    search = config.search
    space = get_space(search.space)
    stored = optuna.create_study(
        study_name=config.name + SIM_SUFFIX, storage=storage, direction="minimize", load_if_exists=True
    )
    stored.set_user_attr("space", search.space)
    name_objective(stored, SIM_METRIC)
    previous = [t for t in stored.trials if t.state.is_finished()]
    study = optuna.create_study(direction="minimize", sampler=make_sampler(search.sampler, search.seed + len(previous)))
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
        objective, n_trials=search.sim_trials, show_progress_bar=show_progress_bar,
        catch=(PlannerError, KeyError, ValueError),
    )
    stored.add_trials(study.trials[len(previous):])
    return study


def complete_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The study's COMPLETE trials (not copied)."""
    return study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))


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
    space = get_space(space_name)
    default_params = space.grid(profile)[0]
    seen: set[str] = set()
    out: list[Candidate] = []
    done = complete_trials(sim_study)
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
