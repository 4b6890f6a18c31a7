"""The Optuna samplers a study's simulated stage can use, by the name ``[search] sampler`` gives.

The registry is typed the way Optuna types its own: each entry builds an
``optuna.samplers.BaseSampler`` from a seed and the constraints function;
``[search] sampler`` is validated against :class:`SamplerName` when the study
is loaded, and ``tests/planner/study/test_samplers.py`` checks that every name
has an entry.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

import optuna

from planner.artifacts.names import SamplerName

Constraints = Callable[[optuna.trial.FrozenTrial], Sequence[float]]
SamplerFactory = Callable[[int, Constraints | None], optuna.samplers.BaseSampler]


def _tpe(seed: int, constraints: Constraints | None) -> optuna.samplers.BaseSampler:
    return optuna.samplers.TPESampler(seed=seed, constraints_func=constraints)


def _nsga2(seed: int, constraints: Constraints | None) -> optuna.samplers.BaseSampler:
    return optuna.samplers.NSGAIISampler(seed=seed, constraints_func=constraints)


def _random(seed: int, constraints: Constraints | None) -> optuna.samplers.BaseSampler:
    return optuna.samplers.RandomSampler(seed=seed)  # samples blind: it takes no constraints


SAMPLERS: Mapping[SamplerName, SamplerFactory] = MappingProxyType({
    SamplerName.TPE: _tpe,
    SamplerName.NSGA2: _nsga2,
    SamplerName.RANDOM: _random,
})


def make_sampler(name: SamplerName, seed: int, constraints_func: Constraints | None = None
                 ) -> optuna.samplers.BaseSampler:
    """A new sampler ``name`` seeded with ``seed``.

    ``constraints_func``: Optuna's (values <= 0 are feasible), e.g. the
    memory budget; the samplers that learn (TPE, NSGA-II) favour feasible
    trials and Optuna stores each trial's constraint values.

    Raises:
        ValueError: ``name`` is not a :class:`SamplerName` (a loaded study
            config never holds one that is not).
    """
    factory = SAMPLERS[SamplerName(name)]
    with warnings.catch_warnings():  # constraints_func is "experimental" in Optuna
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return factory(seed, constraints_func)
