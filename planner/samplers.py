"""The Optuna samplers a study's simulated stage can use, by the name ``[search] sampler`` gives."""

from __future__ import annotations

from typing import Callable

import optuna

SAMPLERS: dict[str, Callable[[int], optuna.samplers.BaseSampler]] = {
    "tpe": lambda seed: optuna.samplers.TPESampler(seed=seed),
    "nsga2": lambda seed: optuna.samplers.NSGAIISampler(seed=seed),
    "random": lambda seed: optuna.samplers.RandomSampler(seed=seed),
}


def make_sampler(name: str, seed: int) -> optuna.samplers.BaseSampler:
    """A new sampler ``name`` (a key of :data:`SAMPLERS`) seeded with ``seed``.

    Raises:
        KeyError: an unknown name (study TOMLs are validated against
            :data:`SAMPLERS` when loaded, so a loaded config never raises).
    """
    return SAMPLERS[name](seed)
