"""The face of a search space: what the study asks of one (the ``search_spaces`` package implements them).

The planner never imports ``search_spaces``: whoever runs a study (``jobs``,
``bench``, the tests) looks the space up by its :class:`SpaceName`
(``search_spaces.get_space``) and hands it in, as Optuna is handed a sampler.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeAlias, runtime_checkable

from planner.artifacts.names import SpaceName
from planner.artifacts.plan import Plan
from planner.artifacts.profile import Profile

ParamValue: TypeAlias = bool | int | float | str
"""One Optuna parameter's value: a categorical's choice, an int or a float."""

TrialParams: TypeAlias = dict[str, ParamValue]
"""A trial's parameters by name, as Optuna stores them (``FrozenTrial.params``) and as a grid enqueues them."""


@runtime_checkable
class SearchSpace(Protocol):
    """Maps an Optuna trial to a :class:`Plan` of a profile's modules.

    A space's parameters are its own (``forward_depth``, ``fwd:<module>``,
    ...); the study stores them on each trial, and the same parameters always
    build the same plan for the same profile (:meth:`build`).
    """

    @property
    def name(self) -> SpaceName:
        """``[search] space``."""
        ...

    def suggest(self, trial: Any, profile: Profile) -> Plan:
        """Draw a plan from ``trial`` (an ``optuna.Trial``)."""
        ...

    def build(self, params: TrialParams, profile: Profile) -> Plan:
        """The plan stored parameters build for ``profile`` (``suggest`` on an ``optuna.trial.FixedTrial``): the one
        way a stored trial, a grid point or a predicted plan becomes a plan.

        Raises:
            SpaceParamsError: the parameters do not build a plan for this profile.
        """
        ...

    def distributions(self, params: TrialParams, profile: Profile) -> dict[str, Any]:
        """The Optuna distributions of the parameters :meth:`build` reads (a trial created from ``params`` records
        them).

        Raises:
            SpaceParamsError: as :meth:`build`.
        """
        ...

    def grid(self, profile: Profile) -> list[TrialParams]:
        """Parameter sets the simulated stage enqueues first, FSDP2's default first."""
        ...

    def uniform_grid(self, profile: Profile) -> list[TrialParams]:
        """The part of :meth:`grid` that sets every module alike: the hand-set baseline every study races
        ([Note: Candidates worth racing] in :mod:`planner.study.candidates`)."""
        ...
