"""The simulated stage: study ``NAME.sim``, thousands of plans predicted, each a trial with two objectives."""

from __future__ import annotations

import warnings

import optuna

from planner.artifacts.config import StudyConfig
from planner.artifacts.memory_budget import PeakBudget
from planner.errors import PlannerError, StudyConfigError
from planner.simulation.simulator import Simulator
from planner.storages.bulk import add_trials_bulk
from planner.study.records import PEAK_OVER_BUDGET, SimulatedTrialRecord, StudyRecord
from planner.study.samplers import make_sampler
from planner.study.search_space import SearchSpace

SIM_SUFFIX = ".sim"
# The simulated study's objectives: predicted step ms and predicted peak bytes per rank (a Pareto front).
SIM_METRICS = ("predicted_step_ms", "predicted_peak_bytes")


def name_objective(study: optuna.Study, *names: str) -> None:
    """``study.set_metric_names(names)`` (optuna-dashboard shows them), without its "experimental" warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names(list(names))


def simulated_stage(
    simulator: Simulator,
    config: StudyConfig,
    storage: optuna.storages.BaseStorage,
    space: SearchSpace,
    show_progress_bar: bool = True,
    budget: PeakBudget | None = None,
) -> optuna.Study:
    """Run ``[search] sim_trials`` simulated trials (fewer if ``sim_timeout_s`` runs out) and store them in study
    ``NAME.sim``.

    Two objectives, both minimized (:data:`SIM_METRICS`): the predicted step
    ms and the predicted peak bytes per rank, so the study holds the
    time/memory Pareto front (``study.best_trials``; ``prefetch-planner
    studies pareto``). With a memory budget each trial carries it as
    Optuna's constraint (``Trial.set_constraint``: peak - budget <= 0 is
    feasible), which TPE and NSGA-II use.

    The trials run in an in-memory Optuna study (an RDB storage costs tens of
    ms per trial, the simulator tens of µs), warm-started with the trials
    ``NAME.sim`` already holds; the new trials are then written to
    ``NAME.sim`` in one transaction (:func:`planner.storages.bulk.add_trials_bulk`).
    On a new study FSDP2's default and the search space's grid
    are enqueued first. A trial whose plan cannot be simulated is recorded as
    FAIL and the study goes on.

    Args:
        simulator: the profile's simulator, with the parameters to predict with
            (``planner.simulation.parameters.simulator_for``).
        config: the study (``[search]`` table).
        storage: where ``NAME.sim`` lives.
        space: the search space (``search_spaces.get_space(config.search.space)``).
        show_progress_bar: Optuna's progress bar.
        budget: the memory budget (its constraint: what a plan is charged over the limit,
            ``PeakBudget.charged``); ``None``: none.

    Returns:
        The in-memory study (stored and new trials).

    Raises:
        StudyConfigError: ``NAME.sim`` exists with one objective (made by an
            older prefetch-planner).
    """
    search, profile = config.search, simulator.profile
    stored = _stored_study(config.name + SIM_SUFFIX, storage, space)
    previous = [t for t in stored.trials if t.state.is_finished()]
    study = optuna.create_study(directions=["minimize", "minimize"],
                                sampler=make_sampler(search.sampler, search.seed + len(previous)))
    study.add_trials(previous)
    if not previous:
        for p in space.grid(profile)[: search.sim_trials]:  # none left waiting
            study.enqueue_trial(p)

    def objective(trial: optuna.Trial) -> tuple[float, float]:
        plan = space.suggest(trial, profile)
        result = simulator.run(plan)
        record = SimulatedTrialRecord(predicted_peak_bytes=result.peak_bytes, exposed_comm_ms=result.exposed_comm_ms)
        for key, value in record.to_user_attrs().items():
            trial.set_user_attr(key, value)
        if budget is not None:  # Optuna's constraint: <= 0 is feasible; TPE and NSGA-II favour them
            trial.set_constraint(PEAK_OVER_BUDGET, float(budget.charged(plan, result.peak_bytes) - budget.limit_bytes))
        return result.step_ms, float(result.peak_bytes)

    with warnings.catch_warnings():  # TPE's multi-objective mode warns on each start
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.optimize(
            objective, n_trials=search.sim_trials, timeout=search.sim_timeout_s, show_progress_bar=show_progress_bar,
            catch=(PlannerError, KeyError, ValueError),
        )
    new = study.trials[len(previous):]
    if isinstance(storage, optuna.storages.RDBStorage):
        add_trials_bulk(storage, config.name + SIM_SUFFIX, new)  # one transaction, not one commit per trial
    else:
        stored.add_trials(new)
    return study


def _stored_study(name: str, storage: optuna.storages.BaseStorage, space: SearchSpace) -> optuna.Study:
    """Study ``name`` (``NAME.sim``), made or loaded, with its two objectives named and its space recorded.

    Raises:
        StudyConfigError: it exists with one objective (made by an older prefetch-planner).
    """
    try:
        stored = optuna.create_study(study_name=name, storage=storage, directions=["minimize", "minimize"],
                                     load_if_exists=True)
    except ValueError as e:
        raise StudyConfigError(
            f"study {name!r} has one objective (made by an older prefetch-planner; {e}); delete it "
            f"(`optuna delete-study --study-name {name} --storage URL`) or name the study anew") from None
    for key, value in StudyRecord(space.name).to_user_attrs().items():
        stored.set_user_attr(key, value)
    name_objective(stored, *SIM_METRICS)
    return stored


def smallest_peak(simulator: Simulator, space: SearchSpace) -> int:
    """The smallest predicted peak over the space's grid, bytes per rank (the least memory any plan needs)."""
    profile = simulator.profile
    return min(
        simulator.run(space.build(g, profile)).peak_bytes for g in space.grid(profile)
    )


def complete_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The study's COMPLETE trials (not copied)."""
    return study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))


