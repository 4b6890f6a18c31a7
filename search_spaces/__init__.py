"""Search spaces: each maps an Optuna trial to a :class:`planner.artifacts.plan.Plan`.

A space is a module with ``NAME``, ``suggest(trial, profile) -> Plan`` and
``grid(profile) -> list[dict]`` (parameter sets to enqueue first, FSDP2's
default first); a space whose grid holds more than uniform plans also has
``uniform_grid(profile)``, the uniform part (the candidate every study races). A new space is one new file plus one line in ``SPACES``.
"""

from __future__ import annotations

from types import ModuleType

from planner.errors import StudyConfigError
from search_spaces import assign, per_module, uniform

SPACES: dict[str, ModuleType] = {uniform.NAME: uniform, per_module.NAME: per_module, assign.NAME: assign}


def get_space(name: str) -> ModuleType:
    """Return the search space module called ``name``.

    Raises:
        StudyConfigError: no such space.
    """
    try:
        return SPACES[name]
    except KeyError:
        raise StudyConfigError(
            f"unknown search space {name!r}; choose one of {', '.join(sorted(SPACES))}"
        ) from None
