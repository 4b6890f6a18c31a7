"""``per_module``: each module's own forward and backward prefetch lists.

Parameters, for every FSDP module ``m`` (FQN, ``<root>`` for the root):
    ``fwd:m`` (0..window): ``m`` explicitly prefetches its next k modules in
        pre-forward order (0: none; if every module has 0, FSDP2's implicit
        forward prefetch).
    ``bwd:m`` (1..window): ``m`` prefetches its next k modules in backward
        order (1: FSDP2's default).
    ``unshard_async_op`` (bool).
The uniform grid is expressible here too and is enqueued first.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from planner.plan import Plan
from planner.profile import Profile
from search_spaces import uniform
from search_spaces._orders import distinct, next_in_backward, next_in_forward

NAME = "per_module"
WINDOW = 3


def _key(prefix: str, fqn: str) -> str:
    return f"{prefix}:{fqn or '<root>'}"


def build(profile: Profile, forward: dict[str, int], backward: dict[str, int], unshard_async_op: bool) -> Plan:
    """The plan with per-module forward/backward counts (see module docstring)."""
    default = Plan.default(profile)
    modules = {
        fqn: dataclasses.replace(
            m,
            forward_prefetch=next_in_forward(profile, fqn, forward[fqn]),
            backward_prefetch=next_in_backward(profile, fqn, backward[fqn]) if backward[fqn] > 1 else (),
        )
        for fqn, m in default.modules.items()
    }
    return dataclasses.replace(default, modules=modules, unshard_async_op=unshard_async_op)


def suggest(trial: Any, profile: Profile) -> Plan:
    """Draw a plan from ``trial`` (an ``optuna.Trial``)."""
    fqns = distinct(profile.pre_forward_order)
    forward = {f: trial.suggest_int(_key("fwd", f), 0, WINDOW) for f in fqns}
    backward = {f: trial.suggest_int(_key("bwd", f), 1, WINDOW) for f in fqns}
    return build(profile, forward, backward, trial.suggest_categorical("unshard_async_op", [False, True]))


def grid(profile: Profile) -> list[dict[str, Any]]:
    """The uniform grid written in this space's parameters, FSDP2's default first."""
    fqns = distinct(profile.pre_forward_order)
    out = []
    for g in uniform.grid(profile):
        params: dict[str, Any] = {_key("fwd", f): g["forward_depth"] for f in fqns}
        params.update({_key("bwd", f): g["backward_depth"] for f in fqns})
        params["unshard_async_op"] = g["unshard_async_op"]
        out.append(params)
    return out
