"""Orders shared by the search spaces.

Forward prefetch targets follow the *pre-forward* order (the order forwards
start: the root first, so the root can prefetch the first block); backward
prefetch targets follow the reverse *post-forward* order, as FSDP2's own
default backward prefetch does (``FSDPParamGroup._backward_prefetch``).
"""

from __future__ import annotations

from planner.profile import Profile


def distinct(order: tuple[str, ...]) -> list[str]:
    """``order`` without repeats, first occurrence kept."""
    return list(dict.fromkeys(order))


def next_in_forward(profile: Profile, fqn: str, depth: int) -> tuple[str, ...]:
    """The ``depth`` modules whose forward starts after ``fqn``'s."""
    order = distinct(profile.pre_forward_order)
    i = order.index(fqn)
    return tuple(order[i + 1 : i + 1 + depth])


def next_in_backward(profile: Profile, fqn: str, depth: int) -> tuple[str, ...]:
    """The ``depth`` modules whose backward runs after ``fqn``'s (reverse post-forward order)."""
    order = distinct(profile.post_forward_order[::-1])
    i = order.index(fqn)
    return tuple(order[i + 1 : i + 1 + depth])
