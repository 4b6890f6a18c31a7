"""``uniform``: one forward depth, one backward depth, the knobs, reshard after forward, for every module.

Parameters:
    forward_depth (0-3): each module explicitly prefetches the next k modules
        in pre-forward order; 0 keeps FSDP2's implicit forward prefetch.
    backward_depth (1-3): each module prefetches the next k modules in
        backward order; 1 keeps FSDP2's default (previous in post-forward order).
    the plan knobs declared for this space (``planner.artifacts.knobs``, ``Knob.spaces``: async unshard), each
        under its name, as its declaration samples it.
    reshard_after_forward (bool): True keeps each module's setting as wrapped
        (FSDP2's default); False keeps every module's parameters unsharded
        from its forward to its backward (``set_reshard_after_forward(False)``:
        one all-gather per module less, its unsharded bytes held through the
        step), torchtitan's ``reshard_after_forward`` policy.
"""

from __future__ import annotations

import itertools
from typing import Any

from planner.artifacts import knobs as knob_registry
from planner.artifacts.knobs import DEFAULT_PLAN_KNOBS, KnobValues
from planner.artifacts.names import SpaceName
from planner.artifacts.plan import ModulePlan, Plan
from planner.artifacts.profile import Profile
from planner.study.search_space import TrialParams
from search_spaces._orders import orders
from search_spaces._space import BaseSpace

MAX_DEPTH = 3


def build(profile: Profile, forward_depth: int, backward_depth: int, knobs: KnobValues = DEFAULT_PLAN_KNOBS,
          reshard_after_forward: bool = True) -> Plan:
    """The plan with the given uniform depths, plan knobs and resharding (see module docstring)."""
    o = orders(profile)
    modules = {
        fqn: ModulePlan(
            forward_prefetch=o.next_in_forward(fqn, forward_depth),
            backward_prefetch=o.next_in_backward(fqn, backward_depth) if backward_depth > 1 else (),
            reshard_after_forward=o.reshard_after_forward[fqn] and reshard_after_forward,
        )
        for fqn in profile.fingerprint.module_fqns
    }
    return Plan(profile.fingerprint, modules, knobs=knobs)


class UniformSpace(BaseSpace):
    """The ``uniform`` space (``planner.study.SearchSpace``): one setting for every module."""

    name = SpaceName.UNIFORM

    def suggest(self, trial: Any, profile: Profile) -> Plan:
        """Draw a plan from ``trial`` (an ``optuna.Trial``)."""
        forward_depth = trial.suggest_int("forward_depth", 0, MAX_DEPTH)
        backward_depth = trial.suggest_int("backward_depth", 1, MAX_DEPTH)
        plan_knobs = knob_registry.sample(trial, profile.fingerprint.device_type, profile.microbatches, self.name,
                                          profile.fingerprint.torch_version)
        reshard = trial.suggest_categorical("reshard_after_forward", [True, False])
        return build(profile, forward_depth, backward_depth, plan_knobs, reshard)

    def grid(self, profile: Profile) -> list[TrialParams]:
        """Every parameter set of the space, FSDP2's default first."""
        knob_grid = knob_registry.grid_params(profile.fingerprint.device_type, profile.microbatches, self.name,
                                              profile.fingerprint.torch_version)
        return [
            {"forward_depth": f, "backward_depth": b, **k, "reshard_after_forward": r}
            for r, k, f, b in itertools.product([True, False], knob_grid, range(MAX_DEPTH + 1),
                                                range(1, MAX_DEPTH + 1))
        ]

    def uniform_grid(self, profile: Profile) -> list[TrialParams]:
        """The whole grid: every plan of this space sets all modules alike."""
        return self.grid(profile)
