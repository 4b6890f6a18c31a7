"""The isolated passes' memory rule ([Note: Profiling within the device's memory] in planner.study.isolation)."""

from __future__ import annotations

import pytest

from planner.artifacts.memory_budget import DEVICE_MEMORY_ENV, MemoryBudget, device_memory_cap
from planner.errors import PlannerError
from planner.study.isolation import isolation_groups, isolation_limit

MIB = 1 << 20


def _groups(budget: str | None, modules, grad_bytes: int = 0, capacity: int | None = None):
    limit = isolation_limit(MemoryBudget.parse(budget) if budget else None, capacity, 100 * MIB)
    return isolation_groups(limit, 100 * MIB, modules, grad_bytes)


def test_isolation_holds_every_module_at_once_or_a_few_at_a_time_under_the_budget():
    """A pass needs the default's peak, the sharded gradients and twice its modules' bytes: 100 + 0 + 2 x (10 + 4 x
    10) = 200 MiB for all five modules at once; under less, the modules fill passes in order; one module over the
    budget alone is refused."""
    modules = [("", 10 * MIB)] + [(f"layers.{i}", 10 * MIB) for i in range(4)]
    every = [("", "layers.0", "layers.1", "layers.2", "layers.3")]
    assert _groups(None, modules) == every  # no budget, no device limit
    assert _groups("+100%", modules) == every  # 200 = 200
    assert _groups("+99%", modules) == [("", "layers.0", "layers.1", "layers.2"), ("layers.3",)]  # 180 fits 199
    assert _groups("+40%", modules) == [("", "layers.0"), ("layers.1", "layers.2"), ("layers.3",)]
    assert _groups("+20%", modules) == [("",), ("layers.0",), ("layers.1",), ("layers.2",), ("layers.3",)]
    uneven = [("", 30 * MIB), ("layers.0", 5 * MIB), ("layers.1", 5 * MIB)]
    assert _groups("+60%", uneven) == [("",), ("layers.0", "layers.1")]
    assert _groups("+70%", uneven) == [("", "layers.0"), ("layers.1",)]  # 100 + 2 x 35 = 170
    # the user's sharded gradients, alive through the passes: 171 > 170
    assert _groups("+70%", uneven, 1 * MIB) == [("",), ("layers.0", "layers.1")]
    with pytest.raises(PlannerError, match=r"a module unsharded with its gradient \('': up to 160.0 MiB per rank\), "
                                           r"over the memory budget \+59% \(159.0 MiB\)"):
        _groups("+59%", uneven)


def test_the_device_memory_limits_the_passes_where_it_is_tighter_than_the_budget():
    """Without a budget, the tightest rank's device memory alone splits the passes; with both, the tighter rules,
    and the refusal names it."""
    modules = [("", 10 * MIB)] + [(f"layers.{i}", 10 * MIB) for i in range(4)]
    assert _groups(None, modules, capacity=140 * MIB) == [("", "layers.0"), ("layers.1", "layers.2"), ("layers.3",)]
    assert _groups("+100%", modules, capacity=140 * MIB) == _groups("+40%", modules)
    assert _groups("+40%", modules, capacity=1 << 40) == _groups("+40%", modules)
    assert isolation_limit(None, None, 100 * MIB) is None
    assert isolation_limit(MemoryBudget.parse("+20%"), 130 * MIB, 100 * MIB) == (120 * MIB, "the memory budget +20%")
    with pytest.raises(PlannerError, match=r"over the device memory the tightest rank can reach \(110.0 MiB\); "
                                           rf"raise memory_budget or {DEVICE_MEMORY_ENV}"):
        _groups("+100%", modules, capacity=110 * MIB)


def test_the_device_memory_setting_is_a_size():
    assert device_memory_cap({}) is None and device_memory_cap({DEVICE_MEMORY_ENV: " "}) is None
    assert device_memory_cap({DEVICE_MEMORY_ENV: "1.5GiB"}) == 3 << 29
    with pytest.raises(PlannerError, match=rf"^{DEVICE_MEMORY_ENV}='lots': 'lots' is not a size"):
        device_memory_cap({DEVICE_MEMORY_ENV: "lots"})
