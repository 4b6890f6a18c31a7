"""What every search space does the same way: rebuild a plan from stored parameters."""

from __future__ import annotations

import warnings
from typing import Any

from planner.artifacts.plan import Plan
from planner.artifacts.profile import Profile
from planner.errors import PlannerError, SpaceParamsError, one_line
from planner.study.search_space import TrialParams


class BaseSpace:
    """The part of ``planner.study.SearchSpace`` the spaces share: :meth:`build` and :meth:`distributions`, both
    from the space's own :meth:`suggest` on an ``optuna.trial.FixedTrial``."""

    name: Any

    def suggest(self, trial: Any, profile: Profile) -> Plan:
        """Draw a plan from ``trial`` (each space's own)."""
        raise NotImplementedError

    def build(self, params: TrialParams, profile: Profile) -> Plan:
        """The plan ``params`` build for ``profile`` (a stored trial's, a grid point's, a predicted plan's); the
        same parameters always build the same plan.

        Raises:
            SpaceParamsError: a parameter is missing (the parameters of another space, or of a model with other
                modules) or outside its distribution.
        """
        return self._fixed(params, profile)[0]

    def distributions(self, params: TrialParams, profile: Profile) -> dict[str, Any]:
        """The Optuna distributions of the parameters :meth:`build` reads (what a trial created from ``params``
        records).

        Raises:
            SpaceParamsError: as :meth:`build`.
        """
        return self._fixed(params, profile)[1]

    def _fixed(self, params: TrialParams, profile: Profile) -> tuple[Plan, dict[str, Any]]:
        import optuna  # the spaces load without it; a study has it loaded already

        trial = optuna.trial.FixedTrial(params)
        try:
            with warnings.catch_warnings():  # FixedTrial only warns of a value outside its distribution
                warnings.simplefilter("error", UserWarning)
                return self.suggest(trial, profile), dict(trial.distributions)
        except (PlannerError, KeyError, ValueError, UserWarning) as e:
            raise SpaceParamsError(f"these parameters do not build a plan in the {self.name} space for this "
                                   f"profile: {one_line(e)}") from None
