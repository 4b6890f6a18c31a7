"""The Optuna samplers a study's simulated stage can use, by the name ``[search] sampler`` gives."""

from __future__ import annotations

import warnings
from typing import Callable, Sequence

import optuna

Constraints = Callable[[optuna.trial.FrozenTrial], Sequence[float]]

SAMPLERS: dict[str, Callable[[int, Constraints | None], optuna.samplers.BaseSampler]] = {
    "tpe": lambda seed, constraints: optuna.samplers.TPESampler(seed=seed, constraints_func=constraints),
    "nsga2": lambda seed, constraints: optuna.samplers.NSGAIISampler(seed=seed, constraints_func=constraints),
    "random": lambda seed, constraints: optuna.samplers.RandomSampler(seed=seed),  # samples blind: no constraints
}


def make_sampler(name: str, seed: int, constraints_func: Constraints | None = None) -> optuna.samplers.BaseSampler:
    """A new sampler ``name`` (a key of :data:`SAMPLERS`) seeded with ``seed``.

    ``constraints_func``: Optuna's (values <= 0 are feasible), e.g. the
    memory budget; the samplers that learn (TPE, NSGA-II) favour feasible
    trials and Optuna stores each trial's constraint values.

    Raises:
        KeyError: an unknown name (study TOMLs are validated against
            :data:`SAMPLERS` when loaded, so a loaded config never raises).
    """
    with warnings.catch_warnings():  # constraints_func is "experimental" in Optuna
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return SAMPLERS[name](seed, constraints_func)
