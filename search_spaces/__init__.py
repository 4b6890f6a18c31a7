"""Search spaces: each maps an Optuna trial to a :class:`planner.artifacts.plan.Plan`.

A space implements ``planner.study.SearchSpace`` (``name``, ``suggest``,
``grid``, ``uniform_grid``); :data:`SPACES` holds one of each, keyed by the
``[search] space`` names (``planner.artifacts.tables.SpaceName``). A new
space is one new file, one new ``SpaceName`` and one line here.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from planner.artifacts.names import SpaceName
from planner.errors import StudyConfigError
from search_spaces.assign import AssignSpace
from search_spaces.per_module import PerModuleSpace
from search_spaces.uniform import UniformSpace

if TYPE_CHECKING:
    from planner.study.search_space import SearchSpace

SPACES: Mapping[SpaceName, SearchSpace] = MappingProxyType(
    {space.name: space for space in (UniformSpace(), PerModuleSpace(), AssignSpace())}
)


def get_space(name: SpaceName | str) -> SearchSpace:
    """The search space called ``name``.

    Raises:
        StudyConfigError: no such space.
    """
    try:
        return SPACES[SpaceName(name)]
    except ValueError:
        raise StudyConfigError(
            f"unknown search space {name!r}; choose one of {', '.join(sorted(SPACES))}"
        ) from None
