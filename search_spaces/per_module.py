"""``per_module``: each module's own forward and backward prefetch lists.

Parameters, for every FSDP module ``m`` (FQN, ``<root>`` for the root; beyond
``MAX_GROUPS`` modules, for every group of consecutive modules in forward
order, named ``first..last``, so a 1000-module model keeps a number of
parameters a sampler can handle):
    ``fwd:m`` (0..window): ``m`` explicitly prefetches its next k modules in
        pre-forward order (0: none; if every module has 0, FSDP2's implicit
        forward prefetch).
    ``bwd:m`` (1..window): ``m`` prefetches its next k modules in backward
        order (1: FSDP2's default).
    the plan knobs declared for this space (``planner.artifacts.knobs``, ``Knob.spaces``: async unshard), each
        under its name.
The uniform grid is expressible here too and is enqueued first.
"""

from __future__ import annotations

from typing import Any

from planner.artifacts import knobs as knob_registry
from planner.artifacts.knobs import DEFAULT_PLAN_KNOBS, KnobValues
from planner.artifacts.names import SpaceName
from planner.artifacts.plan import ModulePlan, Plan
from planner.artifacts.profile import Profile
from planner.study.search_space import TrialParams
from search_spaces._orders import orders
from search_spaces._space import BaseSpace
from search_spaces.uniform import UniformSpace

WINDOW = 3
MAX_GROUPS = 64


def groups(profile: Profile) -> list[tuple[str, list[str]]]:
    """``(name, member FQNs)`` of the parameter groups: one per module up to
    ``MAX_GROUPS`` modules, else ``MAX_GROUPS`` runs of consecutive modules."""
    fqns = orders(profile).forward
    n = len(fqns)
    g = min(n, MAX_GROUPS)
    out = []
    for j in range(g):
        members = fqns[j * n // g : (j + 1) * n // g]
        name = members[0] or "<root>"
        out.append((name if len(members) == 1 else f"{name}..{members[-1]}", members))
    return out


def build(profile: Profile, forward: dict[str, int], backward: dict[str, int],
          knobs: KnobValues = DEFAULT_PLAN_KNOBS) -> Plan:
    """The plan with per-module forward/backward counts (see module docstring); a module outside the orders is
    in no group and keeps FSDP2's default (``search_spaces._orders.Orders``)."""
    o = orders(profile)
    modules = {
        fqn: ModulePlan(
            forward_prefetch=o.next_in_forward(fqn, forward.get(fqn, 0)),
            backward_prefetch=o.next_in_backward(fqn, backward[fqn]) if backward.get(fqn, 1) > 1 else (),
            reshard_after_forward=o.reshard_after_forward[fqn],
        )
        for fqn in profile.fingerprint.module_fqns
    }
    return Plan(profile.fingerprint, modules, knobs=knobs)


class PerModuleSpace(BaseSpace):
    """The ``per_module`` space (``planner.study.SearchSpace``): each module's own prefetch depths."""

    name = SpaceName.PER_MODULE

    def suggest(self, trial: Any, profile: Profile) -> Plan:
        """Draw a plan from ``trial`` (an ``optuna.Trial``)."""
        forward, backward = {}, {}
        for name, members in groups(profile):
            fwd = trial.suggest_int(f"fwd:{name}", 0, WINDOW)
            bwd = trial.suggest_int(f"bwd:{name}", 1, WINDOW)
            for f in members:
                forward[f], backward[f] = fwd, bwd
        return build(profile, forward, backward,
                     knob_registry.sample(trial, profile.fingerprint.device_type, profile.microbatches, self.name,
                                          profile.fingerprint.torch_version))

    def grid(self, profile: Profile) -> list[TrialParams]:
        """The uniform grid written in this space's parameters, FSDP2's default first."""
        names = [name for name, _ in groups(profile)]
        out = []
        for g in UniformSpace().grid(profile):
            if not g["reshard_after_forward"]:  # this space keeps each module's setting
                continue
            params: TrialParams = {f"fwd:{n}": g["forward_depth"] for n in names}
            params.update({f"bwd:{n}": g["backward_depth"] for n in names})
            params.update({name: g[name] for name in knob_registry.default_params(
                profile.fingerprint.device_type, profile.microbatches, self.name, profile.fingerprint.torch_version)})
            out.append(params)
        return out

    def uniform_grid(self, profile: Profile) -> list[TrialParams]:
        """The whole grid: it holds only uniform plans."""
        return self.grid(profile)
