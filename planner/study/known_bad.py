"""Hand-set FSDP2 configurations known to hurt, found in a plan the model arrived with (``prefetch-planner check``).

Each pattern reads the plan (``runtime.current_plan`` wrote it), the model's profile and, where it prices memory,
a budget; it names its source and the fix. Torch-free: the tests build each case from a synthetic profile.

[Note: Forward prefetch meets recompute]
Where activation checkpointing wraps an FSDP module (the checkpoint outside the unit), its recompute in backward
runs the unit's forward again; a forward prefetch list then issues all-gathers of the *next* modules during
backward, which backward does not need and which sit in memory while the recompute runs (AMD Primus #884:
1,026 tok/s/GPU with forward prefetch and recompute, 2,026 once fixed). FSDP2 skips the forward prefetch only when
the unit's own pre-backward already ran (``FSDPState._pre_forward``, ``TrainingState.PRE_BACKWARD``); the
checkpoint inside the unit (torchtitan's ``apply_ac`` wraps each block before ``fully_shard``) keeps it out.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from planner.artifacts.plan import Plan
from planner.artifacts.profile import Profile
from planner.units import mib


class Pattern(enum.StrEnum):
    """A known-bad configuration (:func:`known_bad`)."""

    FORWARD_PREFETCH_WITH_RECOMPUTE = "forward prefetch with recompute"
    DUPLICATED_ALL_GATHERS = "duplicated all-gathers under reentrant checkpointing"
    RESHARD_BELOW_SHARD_GROUP = "integer reshard_after_forward below the shard group size"
    PREFETCH_AT_WORLD_SIZE_1 = "prefetch at world size 1"
    PREFETCH_OUTSIDE_ORDER = "prefetch lists naming modules outside the post-forward order"
    DEPTH_OVER_BUDGET = "a prefetch depth whose all-gathers exceed the memory budget"


@dataclass(frozen=True)
class Finding:
    """One known-bad pattern the plan matches.

    Attributes:
        pattern: which.
        modules: the FSDP modules it concerns (FQNs; ``""`` is the root).
        detail: what was found, one line.
        source: where the pattern is documented.
        fix: what to do.
    """

    pattern: Pattern
    modules: tuple[str, ...]
    detail: str
    source: str
    fix: str

    def line(self) -> str:
        """``forward prefetch with recompute (layers.0, layers.1): ...; fix: ... [AMD Primus #884]``."""
        where = ", ".join(m or "root" for m in self.modules[:4]) + (", ..." if len(self.modules) > 4 else "")
        return f"{self.pattern} ({where}): {self.detail}; fix: {self.fix} [{self.source}]"


def known_bad(plan: Plan, profile: Profile, memory_budget_bytes: int | None = None,
              reentrant: bool = False) -> list[Finding]:
    """The known-bad patterns ``plan`` matches on ``profile``'s model.

    Args:
        plan: the plan the model arrived with.
        profile: the model's profile (its post-forward order, which modules recompute, bytes, world).
        memory_budget_bytes: the per-rank budget to price a prefetch depth against; ``None``: not checked.
        reentrant: the model checkpoints with ``use_reentrant=True`` (from the study or the user).

    Returns:
        The findings, in the order of :class:`Pattern`; empty when none matches.
    """
    out: list[Finding] = []
    modules = profile.modules
    order = set(profile.post_forward_order)
    recomputing = {f for f, m in modules.items() if m.recompute_ms > 0}
    prefetching = {f: m for f, m in plan.modules.items() if m.forward_prefetch}
    hit = sorted(f for f in prefetching if f in recomputing or set(prefetching[f].forward_prefetch) & recomputing)
    if hit:
        out.append(Finding(Pattern.FORWARD_PREFETCH_WITH_RECOMPUTE, tuple(hit),
                           "explicit forward prefetch on checkpointed modules: their recompute in backward issues "
                           "the next modules' all-gathers again", "AMD Primus #884",
                           "drop set_modules_to_forward_prefetch on checkpointed modules, or checkpoint inside "
                           "each FSDP unit (wrap the block before fully_shard)"))
    twice = sorted(f for f, m in modules.items() if m.calls > 1 and f in recomputing)
    if reentrant and recomputing or twice:
        out.append(Finding(Pattern.DUPLICATED_ALL_GATHERS, tuple(twice or sorted(recomputing)),
                           "reentrant checkpointing runs each unit's forward hooks again in backward, so its "
                           "all-gather runs twice a step", "NeMo-Automodel #3373",
                           "checkpoint with use_reentrant=False"))
    shard = profile.fingerprint.shard_size
    ranks = {f: m.reshard_after_forward for f, m in plan.modules.items()
             if not isinstance(m.reshard_after_forward, bool) and m.reshard_after_forward < shard}
    if ranks:
        held = sum(profile.modules[f].unsharded_bytes // n - profile.modules[f].sharded_bytes
                   for f, n in ranks.items() if f in profile.modules)
        out.append(Finding(Pattern.RESHARD_BELOW_SHARD_GROUP, tuple(sorted(ranks)),
                           f"reshard_after_forward={min(ranks.values())} below the shard group's {shard} ranks: "
                           f"each rank holds 1/{min(ranks.values())} of those parameters from forward to backward "
                           f"instead of 1/{shard} (+{mib(max(0, held))} a rank)", "pytorch #147179 (an out of "
                           "memory with reshard_after_forward=8)",
                           "reshard_after_forward=True, or an integer only where the backward all-gather within a "
                           "node pays for the memory"))
    if profile.fingerprint.world_size == 1:
        listing = sorted(f for f, m in plan.modules.items() if m.forward_prefetch or m.backward_prefetch)
        if listing:
            out.append(Finding(Pattern.PREFETCH_AT_WORLD_SIZE_1, tuple(listing),
                               "at world size 1 FSDP2 runs no all-gather, so prefetch lists only add hook work",
                               "torchtitan #2749", "set no prefetch lists when the data-parallel size is 1"))
    outside = sorted(f for f, m in plan.modules.items()
                     if any(t not in order for t in (*m.forward_prefetch, *m.backward_prefetch)))
    if outside:
        named = sorted({t for f in outside for t in (*plan.modules[f].forward_prefetch,
                                                     *plan.modules[f].backward_prefetch) if t not in order})
        out.append(Finding(Pattern.PREFETCH_OUTSIDE_ORDER, tuple(outside),
                           f"they prefetch {', '.join(n or 'root' for n in named)}, which never runs forward in "
                           "the recorded step: an all-gather that nothing waits for",
                           "FSDP2's FSDPParamGroup._prefetch_unshard (unsharded until the next reshard)",
                           "prefetch only modules of the post-forward order"))
    if memory_budget_bytes is not None:
        over = _over_budget(plan, profile, memory_budget_bytes)
        if over:
            fqn, held = over
            out.append(Finding(Pattern.DEPTH_OVER_BUDGET, (fqn,),
                               f"its forward prefetch holds {mib(held)} of all-gather outputs at once, over the "
                               f"budget's {mib(memory_budget_bytes)} with the sharded state", "FSDP2's "
                               "FSDPParamGroup._prefetch_unshard (each prefetched unit unsharded until used)",
                               "a smaller forward prefetch depth, or tune under the budget (memory_budget)"))
    return out


def _over_budget(plan: Plan, profile: Profile, budget: int) -> tuple[str, int] | None:
    """The first module whose forward prefetch, with its own unsharded parameters and the sharded state, exceeds
    ``budget``: ``(fqn, bytes held)``; ``None`` where none does."""
    base = sum(m.sharded_bytes for m in profile.modules.values()) + profile.optimizer_state_bytes
    for fqn, mp in plan.modules.items():
        own = profile.modules[fqn].unsharded_bytes if fqn in profile.modules else 0
        held = own + sum(profile.modules[t].unsharded_bytes for t in mp.forward_prefetch if t in profile.modules)
        if mp.forward_prefetch and base + held > budget:
            return fqn, held
    return None


def summary_lines(findings: Sequence[Finding]) -> list[str]:
    """One line per finding, or one saying none matched."""
    if not findings:
        return ["known-bad patterns: none matched"]
    return [f"known-bad pattern: {f.line()}" for f in findings]
