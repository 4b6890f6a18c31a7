"""``assign``: for each FSDP module, how far ahead its all-gather is issued, and whether it reshards after forward.

Parameters, for every parameter group ``m`` of :func:`search_spaces.per_module.groups`
(one per module up to ``MAX_GROUPS`` modules, else runs of consecutive modules):
    ``fwd:m`` (0..WINDOW): forward issue distance. 0: on demand, in the
        module's own pre-forward (FSDP2's implicit forward prefetch, which
        needs CPU run-ahead: none on a CPU device); k: issued by the module k
        before it in pre-forward order (the root, when fewer precede it).
    ``bwd:m`` (1..WINDOW): backward issue distance, the same in backward
        order (reverse post-forward order). 1 is FSDP2's default (the module
        before it in backward order prefetches it). 0 is not offered: a
        plan's empty backward list means FSDP2's default, so "on demand in
        backward" is not expressible.
    ``raf:m`` (bool): the module reshards after forward (the root keeps its
        parameters, as FSDP2 wraps it); False keeps its parameters unsharded
        from forward to backward: one all-gather less, its unsharded bytes
        held across the step.
    ``uib:m`` (bool; only for groups whose parameters backward does not read,
        ``ModuleProfile.needs_parameters_in_backward``, e.g. an embedding):
        False skips its all-gather in backward (``set_unshard_in_backward``);
        generally ``f"{knob.param}:m"`` for each module knob.
    the plan knobs (``planner.artifacts.knobs.PLAN_KNOBS``), each as its
        declaration samples it (e.g. ``unshard_async_op``, bool), and where
        declared the module knobs per group (``uib:m`` above).

The distances map onto FSDP2's per-issuer lists: a module issued at forward
distance k is appended to ``forward_prefetch`` of the module k before it
(``set_modules_to_forward_prefetch`` on the issuing module); backward alike
(``set_modules_to_backward_prefetch``). An issuer whose targets are all issued
earlier keeps an empty list. The uniform grid is expressible here too and is
enqueued first (uniform depth d is every distance d), then plans that keep
the last k modules unsharded (:func:`grid`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from planner.artifacts import knobs
from planner.artifacts.knobs import DEFAULT_MODULE_KNOBS, DEFAULT_PLAN_KNOBS, Knob, KnobValues
from planner.artifacts.names import SpaceName
from planner.artifacts.plan import ModulePlan, Plan
from planner.artifacts.profile import Profile
from planner.study.search_space import TrialParams
from search_spaces._orders import orders
from search_spaces._space import BaseSpace
from search_spaces.per_module import groups
from search_spaces.uniform import UniformSpace

WINDOW = 3
ASYNC = KnobValues(unshard_async_op=True)
"""The plan knobs of the "keep the last k" grid's async plans: async unshard lets a prefetched all-gather run beside
compute where the CPU issues it (a CPU device)."""


def build(profile: Profile, forward: dict[str, int], backward: dict[str, int], reshard_after_forward: dict[str, bool],
          knobs: KnobValues | None = None, module_knobs: dict[str, KnobValues] | None = None) -> Plan:
    """The plan with per-module issue distances and reshard flags (see module docstring).

    Args:
        forward: FQN -> forward issue distance (0: on demand).
        backward: FQN -> backward issue distance (>= 1; 1: FSDP2's default).
        reshard_after_forward: FQN -> whether it reshards after forward
            (ignored for modules wrapped not to, e.g. the root).
        knobs: the plan's knobs (default: FSDP2's).
        module_knobs: FQN -> its module knobs (modules left out: FSDP2's defaults).

    Raises:
        KeyError: an FQN of the profile's orders is missing from a mapping (a module outside the orders,
            ``search_spaces._orders.Orders``, may be left out: it keeps FSDP2's default).
    """
    o = orders(profile)
    fwd_lists: dict[str, list[str]] = {f: [] for f in o.forward}
    for pos, target in enumerate(o.forward):
        if forward[target] > 0 and pos > 0:
            fwd_lists[o.forward[max(0, pos - forward[target])]].append(target)
    bwd_lists: dict[str, list[str]] = {f: [] for f in o.backward}
    explicit = any(backward[f] != 1 for f in o.backward[1:])
    for pos, target in enumerate(o.backward):
        if explicit and pos > 0:
            bwd_lists[o.backward[max(0, pos - backward[target])]].append(target)
    modules = {
        fqn: ModulePlan(
            forward_prefetch=tuple(fwd_lists.get(fqn, ())),  # a module outside the orders: FSDP2's default
            backward_prefetch=tuple(bwd_lists.get(fqn, ())),
            reshard_after_forward=o.reshard_after_forward[fqn] and reshard_after_forward.get(fqn, True),
            knobs=(module_knobs or {}).get(fqn, DEFAULT_MODULE_KNOBS),
        )
        for fqn in profile.fingerprint.module_fqns
    }
    return Plan(profile.fingerprint, modules, knobs=knobs or KnobValues())


class AssignSpace(BaseSpace):
    """The ``assign`` space (``planner.study.SearchSpace``): per module, issue distances and resharding."""

    name = SpaceName.ASSIGN

    def suggest(self, trial: Any, profile: Profile) -> Plan:
        """Draw a plan from ``trial`` (an ``optuna.Trial``)."""
        forward, backward, resharding, module_knobs = {}, {}, {}, {}
        for name, members in groups(profile):
            fwd = trial.suggest_int(f"fwd:{name}", 0, WINDOW)
            bwd = trial.suggest_int(f"bwd:{name}", 1, WINDOW)
            keep = trial.suggest_categorical(f"raf:{name}", [True, False])
            own = KnobValues({k.name: knobs.suggest(trial, k, f"{k.param}:{name}") for k in _module_knobs(
                profile, members)}, module=True)
            for f in members:
                forward[f], backward[f], resharding[f], module_knobs[f] = fwd, bwd, keep, own
        plan_knobs = knobs.sample(trial, profile.fingerprint.device_type, profile.microbatches,
                                   torch_version=profile.fingerprint.torch_version)
        return build(profile, forward, backward, resharding, plan_knobs, module_knobs)

    def grid(self, profile: Profile) -> list[TrialParams]:
        """The uniform grid written in this space's parameters (FSDP2's default first), then "keep the last k".

        The second part: prefetch 1 (sync and async) and 2 (async) with the last
        k parameter groups in post-forward order kept unsharded after forward,
        for every k between none and all. They are the cheapest way to spend
        memory on fewer all-gathers: the last modules' parameters are held the
        shortest, from their forward to their backward, which comes first.
        """
        names = [name for name, _ in groups(profile)]
        out = self.uniform_grid(profile)
        for fwd, bwd, plan_knobs in ((1, 1, ASYNC), (1, 1, DEFAULT_PLAN_KNOBS), (2, 2, ASYNC)):
            for k in range(1, len(names) - 1):
                out.append(_params(profile, names, fwd, bwd, plan_knobs, [True] * (len(names) - k) + [False] * k))
        return out

    def uniform_grid(self, profile: Profile) -> list[TrialParams]:
        """The uniform grid (``UniformSpace.grid``) in this space's parameters, FSDP2's default first."""
        names = [name for name, _ in groups(profile)]
        device_type, microbatches = profile.fingerprint.device_type, profile.microbatches
        return [_params(profile, names, g["forward_depth"], g["backward_depth"],
                        knobs.from_params(g, device_type, microbatches, SpaceName.UNIFORM,
                                          profile.fingerprint.torch_version),
                        [g["reshard_after_forward"]] * len(names)) for g in UniformSpace().grid(profile)]


def _params(profile: Profile, names: list[str], fwd: int, bwd: int, plan_knobs: KnobValues, resharding: list[bool]
            ) -> TrialParams:
    params: TrialParams = {f"fwd:{n}": fwd for n in names}
    params.update({f"bwd:{n}": bwd for n in names})
    params.update({f"raf:{n}": r for n, r in zip(names, resharding, strict=True)})
    params.update({f"{k.param}:{n}": k.default for n, members in groups(profile)
                   for k in _module_knobs(profile, members)})
    params.update({name: plan_knobs[name]
                   for name in knobs.default_params(profile.fingerprint.device_type, profile.microbatches,
                                                     torch_version=profile.fingerprint.torch_version)})
    return params


def _module_knobs(profile: Profile, members: list[str]) -> list[Knob]:
    """The module knobs sampled for a parameter group (``planner.artifacts.knobs.sampled``)."""
    return [k for k in knobs.MODULE_KNOBS if knobs.sampled(k, profile.fingerprint.device_type, profile.microbatches,
                                                             _skippable(profile, members),
                                                             torch_version=profile.fingerprint.torch_version)]


def _skippable(profile: Profile, members: list[str]) -> bool:
    """Whether backward reads none of the group's parameters, so its backward all-gather may be skipped."""
    return not any(profile.modules[f].needs_parameters_in_backward for f in members)


def keep_unsharded(plan: Plan, profile: Profile, blocks: int) -> Plan:
    """``plan`` with the last ``blocks`` modules in post-forward order (the first in backward) kept unsharded
    after forward (``reshard_after_forward=False``); the root is not counted."""
    last = [f for f in orders(profile).backward if f != profile.root_fqn][:blocks]
    return dataclasses.replace(plan, modules={
        f: dataclasses.replace(m, reshard_after_forward=False) if f in last else m for f, m in plan.modules.items()})
