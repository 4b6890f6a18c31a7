"""The simulated stage (study ``NAME.sim``) and the choice of candidates for the measured stage."""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass
from typing import Any

import optuna

from planner.artifacts.config import StudyConfig
from planner.errors import PlannerError, StudyConfigError
from planner.artifacts.plan import Plan
from planner.artifacts.profile import Profile
from planner.study.samplers import make_sampler
from planner.simulation.parameters import simulator_for
from planner.simulation.simulator import SimParams
from planner.storages.bulk import add_trials_bulk
from search_spaces import get_space

SIM_SUFFIX = ".sim"
# The simulated study's objectives: predicted step ms and predicted peak bytes per rank (a Pareto front).
SIM_METRICS = ("predicted_step_ms", "predicted_peak_bytes")
SIM_METRIC = SIM_METRICS[0]

# [Note: Candidates worth racing]
# The race can only confirm what it is given, and the uncalibrated model ties
# plans that behave differently on the ranks (four candidates at one
# predicted ms on a holdout workload). So the candidates are: the best plan
# of the uniform grid (FSDP2's usual hand-set knobs), always, so a per-module
# plan has to beat it on the real ranks; then, among plans predicted within
# ``band_pct`` of the best, one plan per kind (the same knobs and the same
# predicted timeline make near-copies the model cannot tell apart), the one
# with the lowest predicted peak memory; then the next best by prediction.


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


def name_objective(study: optuna.Study, *names: str) -> None:
    """``study.set_metric_names(names)`` (optuna-dashboard shows them), without its "experimental" warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names(list(names))


def plan_key(plan: Plan) -> str:
    """A short digest of :meth:`Plan.behaviour_key`, stored as trial attribute ``plan_key``."""
    return hashlib.sha1(plan.behaviour_key().encode()).hexdigest()[:16]


def simulated_stage(
    profile: Profile,
    config: StudyConfig,
    storage: optuna.storages.BaseStorage,
    params: SimParams | None = None,
    show_progress_bar: bool = True,
    budget_bytes: int | None = None,
) -> optuna.Study:
    """Run ``[search] sim_trials`` simulated trials and store them in study ``NAME.sim``.

    Two objectives, both minimized (:data:`SIM_METRICS`): the predicted step
    ms and the predicted peak bytes per rank, so the study holds the
    time/memory Pareto front (``study.best_trials``; ``prefetch-planner
    studies pareto``). With a memory budget each trial carries it as
    Optuna's constraint (``Trial.set_constraint``: peak - budget <= 0 is
    feasible), which TPE and NSGA-II use.

    The trials run in an in-memory Optuna study (an RDB storage costs tens of
    ms per trial, the simulator tens of µs), warm-started with the trials
    ``NAME.sim`` already holds; the new trials are then written to
    ``NAME.sim`` in one transaction (:func:`planner.storages.bulk.add_trials_bulk`). On a new study FSDP2's default and the search space's grid
    are enqueued first. A trial whose plan cannot be simulated is recorded as
    FAIL and the study goes on.

    Args:
        profile: the profile to simulate on (its calibration, if any, is used).
        config: the study (``[search]`` table).
        storage: where ``NAME.sim`` lives.
        params: simulator parameters instead of the profile's calibration.
        show_progress_bar: Optuna's progress bar.
        budget_bytes: the memory budget, bytes per rank; ``None``: none.

    Returns:
        The in-memory study (stored and new trials).

    Raises:
        StudyConfigError: ``NAME.sim`` exists with one objective (made by an
            older prefetch-planner).
    """
    search = config.search
    space = get_space(search.space)
    try:
        stored = optuna.create_study(study_name=config.name + SIM_SUFFIX, storage=storage,
                                     directions=["minimize", "minimize"], load_if_exists=True)
    except ValueError as e:
        raise StudyConfigError(
            f"study {config.name + SIM_SUFFIX!r} has one objective (made by an older prefetch-planner; {e}); "
            f"delete it (`optuna delete-study --study-name {config.name + SIM_SUFFIX} --storage URL`) or name the "
            "study anew") from None
    stored.set_user_attr("space", search.space)
    name_objective(stored, *SIM_METRICS)
    previous = [t for t in stored.trials if t.state.is_finished()]
    study = optuna.create_study(directions=["minimize", "minimize"],
                                sampler=make_sampler(search.sampler, search.seed + len(previous)))
    study.add_trials(previous)
    if not previous:
        for p in space.grid(profile)[: search.sim_trials]:  # none left waiting
            study.enqueue_trial(p)

    simulator = simulator_for(profile, params)

    def objective(trial: optuna.Trial) -> tuple[float, float]:
        plan = space.suggest(trial, profile)
        result = simulator.run(plan)
        trial.set_user_attr("peak_bytes", result.peak_bytes)
        trial.set_user_attr("exposed_comm_ms", result.exposed_comm_ms)
        if budget_bytes is not None:  # Optuna's constraint: <= 0 is feasible; TPE and NSGA-II favour feasible trials
            trial.set_constraint("peak_over_budget_bytes", float(result.peak_bytes - budget_bytes))
        return result.step_ms, float(result.peak_bytes)

    with warnings.catch_warnings():  # TPE's multi-objective mode warns on each start
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.optimize(
            objective, n_trials=search.sim_trials, show_progress_bar=show_progress_bar,
            catch=(PlannerError, KeyError, ValueError),
        )
    new = study.trials[len(previous):]
    if isinstance(storage, optuna.storages.RDBStorage):
        add_trials_bulk(storage, config.name + SIM_SUFFIX, new)  # one transaction, not one commit per trial
    else:
        stored.add_trials(new)
    return study


def smallest_peak(profile: Profile, space_name: str, params: SimParams | None = None) -> int:
    """The smallest predicted peak over the space's grid, bytes per rank (the least memory any plan needs)."""
    space = get_space(space_name)
    simulator = simulator_for(profile, params)
    return min(simulator.run(space.suggest(optuna.trial.FixedTrial(g), profile)).peak_bytes for g in space.grid(profile))


def complete_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The study's COMPLETE trials (not copied)."""
    return study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))


def distinct_plans(sim_study: optuna.Study, profile: Profile, space_name: str
                   ) -> list[tuple[optuna.trial.FrozenTrial, Plan]]:
    """The study's COMPLETE trials and their plans, one per behaviour (:meth:`Plan.behaviour_key`), best predicted first."""
    space = get_space(space_name)
    seen: set[str] = set()
    out = []
    for t in sorted(complete_trials(sim_study), key=lambda t: (t.values[0], t.number)):
        plan = space.suggest(optuna.trial.FixedTrial(t.params), profile)
        if plan.behaviour_key() not in seen:
            seen.add(plan.behaviour_key())
            out.append((t, plan))
    return out


def select_candidates(
    sim_study: optuna.Study, profile: Profile, space_name: str, k: int, exclude: frozenset[str] | set[str] = frozenset(),
    band_pct: float = 5.0, budget_bytes: int | None = None,
) -> list[Candidate]:
    """FSDP2's default followed by up to ``k`` simulated plans worth racing ([Note: Candidates worth racing]).

    Plans whose :func:`plan_key` is in ``exclude`` (measured already, being
    measured by another job, or failed on a rank) are skipped; the default
    never is: it is every job's baseline.

    Args:
        band_pct: plans predicted within this many % of the best are "as good
            as the model can tell"; among them the selection prefers plans
            that differ in what they do.
        budget_bytes: only plans predicted within this peak (bytes per rank)
            are candidates; ``None``: no budget.
    """
    space = get_space(space_name)
    grid = getattr(space, "uniform_grid", space.grid)(profile)  # the hand-set baseline: uniform knobs only
    ranked = distinct_plans(sim_study, profile, space_name)
    default = next(((t, p) for t, p in ranked if p.is_default_for(profile)), None)
    rest = [(t, p) for t, p in ranked if not p.is_default_for(profile) and plan_key(p) not in exclude
            and (budget_bytes is None or _peak(t) <= budget_bytes)]
    chosen: list[tuple[optuna.trial.FrozenTrial, Plan]] = []
    uniform = [(t, p) for t, p in rest if t.params in grid]
    if uniform and k > 0:
        chosen.append(uniform[0])  # the best uniform plan: a per-module plan must beat it on the ranks
    if rest:
        best_ms = rest[0][0].values[0]
        kinds: dict[tuple, list[tuple[optuna.trial.FrozenTrial, Plan]]] = {}
        for t, p in rest:
            if t.values[0] <= best_ms * (1.0 + band_pct / 100.0):
                kinds.setdefault(_what_it_does(t, p, best_ms), []).append((t, p))
        # One plan per kind: the lowest predicted peak, then the faster, then the earlier trial.
        picks = [min(g, key=lambda tp: (_peak(tp[0]), tp[0].values[0], tp[0].number))
                 for g in kinds.values()]
        taken = {_what_it_does(t, p, best_ms) for t, p in chosen}
        for t, p in sorted(picks, key=lambda tp: (tp[0].values[0], _peak(tp[0]), tp[0].number)):
            if len(chosen) < k and _what_it_does(t, p, best_ms) not in taken:
                chosen.append((t, p))
                taken.add(_what_it_does(t, p, best_ms))
        for t, p in rest:  # fewer kinds than slots: the next best by prediction
            if len(chosen) < k and all(t is not c for c, _ in chosen):
                chosen.append((t, p))
    return [_candidate(t, p) for t, p in ([default] if default else []) + chosen[:k]]


def _what_it_does(trial: optuna.trial.FrozenTrial, plan: Plan, best_ms: float) -> tuple:
    """Plans alike here are near-copies the model cannot tell apart: the same knobs and the same predicted step."""
    kept = frozenset(f for f, m in plan.modules.items() if not m.reshard_after_forward)
    return (plan.unshard_async_op, plan.reduce_scatter_max_input_buffers, plan.reshard_after_backward,
            plan.separate_reduce_scatter_group, kept,
            round(trial.values[0] / best_ms, 3), round(trial.user_attrs.get("exposed_comm_ms", 0.0) / max(best_ms, 1e-9), 3))


def _peak(trial: optuna.trial.FrozenTrial) -> int:
    """A simulated trial's predicted peak, bytes per rank."""
    return int(trial.user_attrs.get("peak_bytes", 0))


def _candidate(trial: optuna.trial.FrozenTrial, plan: Plan) -> Candidate:
    return Candidate(trial.params, trial.distributions, plan, trial.values[0], _peak(trial))
