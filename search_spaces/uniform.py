"""``uniform``: one forward depth, one backward depth, async unshard, for every module.

Parameters:
    forward_depth (0-3): each module explicitly prefetches the next k modules
        in pre-forward order; 0 keeps FSDP2's implicit forward prefetch.
    backward_depth (1-3): each module prefetches the next k modules in
        backward order; 1 keeps FSDP2's default (previous in post-forward order).
    unshard_async_op (bool): ``_set_unshard_async_op``.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from planner.plan import Plan
from planner.profile import Profile
from search_spaces._orders import next_in_backward, next_in_forward

NAME = "uniform"
MAX_DEPTH = 3


def build(profile: Profile, forward_depth: int, backward_depth: int, unshard_async_op: bool) -> Plan:
    """The plan with the given uniform depths (see module docstring)."""
    default = Plan.default(profile)
    modules = {
        fqn: dataclasses.replace(
            m,
            forward_prefetch=next_in_forward(profile, fqn, forward_depth),
            backward_prefetch=next_in_backward(profile, fqn, backward_depth) if backward_depth > 1 else (),
        )
        for fqn, m in default.modules.items()
    }
    return dataclasses.replace(default, modules=modules, unshard_async_op=unshard_async_op)


def suggest(trial: Any, profile: Profile) -> Plan:
    """Draw a plan from ``trial`` (an ``optuna.Trial``)."""
    return build(
        profile,
        trial.suggest_int("forward_depth", 0, MAX_DEPTH),
        trial.suggest_int("backward_depth", 1, MAX_DEPTH),
        trial.suggest_categorical("unshard_async_op", [False, True]),
    )


def grid(profile: Profile) -> list[dict[str, Any]]:
    """Every parameter set of the space, FSDP2's default first."""
    return [
        {"forward_depth": f, "backward_depth": b, "unshard_async_op": a}
        for a, f, b in itertools.product([False, True], range(MAX_DEPTH + 1), range(1, MAX_DEPTH + 1))
    ]
