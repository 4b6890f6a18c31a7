"""Orders shared by the search spaces.

Forward prefetch targets follow the *pre-forward* order (the order forwards
start: the root first, so the root can prefetch the first block); backward
prefetch targets follow the reverse *post-forward* order, as FSDP2's own
default backward prefetch does (``FSDPParamGroup._backward_prefetch``).

The orders and each module's position in them are computed per plan built
(linear in the number of modules, as building the plan is).
"""

from __future__ import annotations

from planner.artifacts.profile import Profile


class Orders:
    """Distinct forward and backward orders of a profile's FSDP modules.

    A module whose forward runs outside the root's (torchtitan's ``ChunkedLossWrapper`` calls ``lm_head`` from
    the loss, after the root's forward ends) is in neither order: it neither prefetches nor is prefetched, and
    keeps FSDP2's default.
    """

    def __init__(self, profile: Profile):
        self.forward = list(dict.fromkeys(profile.pre_forward_order))
        self.backward = list(dict.fromkeys(profile.post_forward_order[::-1]))
        self.forward_pos = {f: i for i, f in enumerate(self.forward)}
        self.backward_pos = {f: i for i, f in enumerate(self.backward)}
        self.reshard_after_forward = {f: m.reshard_after_forward for f, m in profile.modules.items()}

    def next_in_forward(self, fqn: str, depth: int) -> tuple[str, ...]:
        """The ``depth`` modules whose forward starts after ``fqn``'s; none for a module outside the root's
        forward (see :class:`Orders`)."""
        if fqn not in self.forward_pos:
            return ()
        i = self.forward_pos[fqn] + 1
        return tuple(self.forward[i : i + depth])

    def next_in_backward(self, fqn: str, depth: int) -> tuple[str, ...]:
        """The ``depth`` modules whose backward runs after ``fqn``'s (reverse post-forward order); none for a
        module outside the root's forward."""
        if fqn not in self.backward_pos:
            return ()
        i = self.backward_pos[fqn] + 1
        return tuple(self.backward[i : i + depth])


def orders(profile: Profile) -> Orders:
    """The profile's :class:`Orders`."""
    return Orders(profile)
