"""Which FSDP modules the recorder's isolated passes hold unsharded together: the one rule for ``tune``,
``profile`` and the in-loop tuner, torch-free.

[Note: Profiling within the device's memory]
A pass holds its modules' parameters unsharded, and with gradient sync off their unsharded gradients too
(``runtime.recording.isolated.compute_unsharded``), beside what the model keeps between two steps. Profiling a
model that needs FSDP to fit with every module unsharded at once runs out of memory before any plan exists. So the
passes hold what fits under the tighter of two limits, per rank:

- the device's memory: what the tightest rank can reach (``runtime.ranks.device.Device.capacity_bytes``: on CUDA
  the caching allocator's reserved bytes plus the device's free bytes, less a margin; on CPU the cap a setting
  gives, ``PREFETCH_PLANNER_DEVICE_MEMORY``, else none);
- the study's ``[search] memory_budget``, the peak a plan may reach.

A pass is charged FSDP2's default step's measured peak (the plan the model runs while it is recorded), the sharded
gradients, and twice the held modules' unsharded bytes: an upper bound, since the default step already holds some
modules unsharded and its peak may come with the gradients alive. Where every module fits, one pass holds them all;
else the modules fill passes in turn (greedy, in the model's order).
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.artifacts.memory_budget import DEVICE_MEMORY_ENV, MemoryBudget
from planner.errors import PlannerError
from planner.units import mib


def isolation_limit(budget: MemoryBudget | None, capacity_bytes: int | None,
                    default_peak_bytes: int) -> tuple[int, str] | None:
    """The bytes per rank a pass may reach, and what sets it in words; ``None``: no limit.

    Args:
        budget: the study's memory budget (``None``: none).
        capacity_bytes: the tightest rank's device memory it can reach, bytes (``None``: not known, a CPU without
            a cap).
        default_peak_bytes: FSDP2's default step's measured peak, bytes per rank (max across ranks): a relative
            budget is relative to it.
    """
    limits = []
    if budget is not None:
        limits.append((budget.resolve(default_peak_bytes), f"the memory budget {budget.text}"))
    if capacity_bytes is not None:
        limits.append((capacity_bytes, "the device memory the tightest rank can reach"))
    return min(limits) if limits else None


def isolation_groups(limit: tuple[int, str] | None, default_peak_bytes: int,
                     module_bytes: Sequence[tuple[str, int]], grad_bytes: int = 0) -> list[tuple[str, ...]]:
    """The passes: the FSDP modules each holds unsharded ([Note: Profiling within the device's memory]).

    Args:
        limit: :func:`isolation_limit`'s.
        default_peak_bytes: FSDP2's default step's measured peak, bytes per rank (max across ranks).
        module_bytes: ``(fqn, unsharded parameter bytes)`` of every FSDP module, the root first.
        grad_bytes: the sharded gradients' bytes per rank (the unsharded bytes over the world size).

    Returns:
        The passes, each a tuple of FQNs; together every module once.

    Raises:
        PlannerError: a single module does not fit under the limit: no pass can hold it.
    """
    everything = [tuple(fqn for fqn, _ in module_bytes)]
    base = default_peak_bytes + grad_bytes
    if limit is None or base + 2 * sum(b for _, b in module_bytes) <= limit[0]:
        return everything
    groups: list[tuple[str, ...]] = []
    group: list[str] = []
    held = 0
    for fqn, nbytes in module_bytes:
        if base + 2 * nbytes > limit[0]:
            raise PlannerError(
                f"the recorder's isolated passes hold a module unsharded with its gradient ({fqn!r}: up to "
                f"{mib(base + 2 * nbytes)} per rank), over {limit[1]} ({mib(limit[0])}); raise memory_budget or "
                f"{DEVICE_MEMORY_ENV}, or record the profile where memory allows (`prefetch-planner "
                "profile`) and tune with `prefetch-planner tune --from-profile`")
        if group and base + 2 * (held + nbytes) > limit[0]:
            groups.append(tuple(group))
            group, held = [], 0
        group.append(fqn)
        held += nbytes
    groups.append(tuple(group))
    return groups
