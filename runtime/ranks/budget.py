"""The default memory budget on a CUDA device, for every entry point (``tune`` and the in-loop tuner).

A full GPU is the job's: where the study sets no ``[search] memory_budget``, the budget on CUDA is what the tightest
rank can still reach (``Device.capacity_bytes``: the caching allocator's reserved bytes plus the device's free bytes,
at most the process's memory fraction, less a margin: ``planner.artifacts.memory_budget.device_budget``). Each
candidate is then charged its predicted peak, the simulator's error on the job's own baseline and an allowance for
each NCCL communicator it adds (``planner.artifacts.memory_budget.PeakBudget``). On CPU no default is set.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from planner.artifacts.config import StudyConfig
from planner.artifacts.memory_budget import DEVICE_MARGIN
from planner.errors import PlannerError
from planner.units import mib
from runtime.ranks.collectives import gather_objects
from runtime.ranks.device import Device, device_of


def tightest_capacity(device: Device, gather: Callable[[Any], list[Any]]) -> int | None:
    """The least ``device.capacity_bytes()`` across ranks, bytes (``None``: no rank knows one); collective through
    ``gather`` (every rank's object, by rank). A bad setting on any rank is raised on every rank, after the gather,
    so that no rank is left waiting in it.

    Raises:
        PlannerError: ``PREFETCH_PLANNER_DEVICE_MEMORY`` is set but not a size on some rank.
    """
    try:
        mine: tuple[int | None, str | None] = (device.capacity_bytes(), None)
    except PlannerError as e:
        mine = (None, str(e))
    capacities, errors = zip(*gather(mine), strict=True)
    if any(errors):
        raise PlannerError(next(e for e in errors if e))
    known = [c for c in capacities if c is not None]
    return min(known) if known else None


def with_device_budget(config: StudyConfig, device_type: str, group: Any = None) -> tuple[StudyConfig, str | None]:
    """``config`` with the default budget on CUDA where it sets none (collective on ``group``: every rank calls
    it, and every rank gets the same budget, the tightest rank's), and the line to log; as it is elsewhere, with
    ``None``.

    Raises:
        PlannerError: ``PREFETCH_PLANNER_DEVICE_MEMORY`` is set but not a size.
    """
    if config.search.memory_budget is not None or device_type != "cuda":
        return config, None
    reachable = tightest_capacity(device_of("cuda"), lambda obj: gather_objects(obj, group))
    line = (f"memory budget {mib(reachable)} per rank: what the tightest rank's device can reach (reserved plus "
            f"free, within the process's memory fraction) less {DEVICE_MARGIN:.0%} of it; set [search] memory_budget "
            "for another")
    search = config.search.model_copy(update={"memory_budget": f"{reachable}B"})
    return config.model_copy(update={"search": search}), line
