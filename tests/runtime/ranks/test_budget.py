"""The default memory budget on CUDA for every entry point (runtime.ranks.budget), on a fake device and ranks."""

from __future__ import annotations

import pytest

import runtime.ranks.budget as budget
import runtime.ranks.device as device
from planner.artifacts.memory_budget import DEVICE_MEMORY_ENV, MemoryBudget
from planner.errors import PlannerError
from planner.testing import study_config

GIB = 2 ** 30


class FakeCUDA(device.CUDADevice):
    """A CUDA device's memory as scripted: 60 GiB free of 80, 12 GiB reserved, the process held to ``fraction``."""

    def __init__(self, fraction: float = 1.0):
        self.fraction = fraction

    def free_and_total(self):
        return 60 * GIB, 80 * GIB

    def reserved(self):
        return 12 * GIB

    def memory_fraction(self):
        return self.fraction


@pytest.fixture
def ranks(monkeypatch):
    """Two ranks, this one and a tighter one (its device can reach 40 GiB), gathered as a control group would."""
    def gather(obj, group=None):
        return [obj, (40 * GIB, None)]

    monkeypatch.setattr(budget, "gather_objects", gather)
    monkeypatch.delenv(DEVICE_MEMORY_ENV, raising=False)
    return monkeypatch


def test_on_cuda_without_a_budget_the_tightest_ranks_reachable_memory_is_the_budget(tmp_path, ranks):
    ranks.setattr(budget, "device_of", lambda kind: FakeCUDA())
    config, line = budget.with_device_budget(study_config(tmp_path), "cuda")
    assert MemoryBudget.parse(config.search.memory_budget).resolve(None) == 40 * GIB  # the other rank's
    assert line.startswith("memory budget 40960.0 MiB per rank: what the tightest rank's device can reach")
    ranks.setattr(budget, "device_of", lambda kind: FakeCUDA(fraction=0.25))  # 20 GiB less 8
    config, _ = budget.with_device_budget(study_config(tmp_path), "cuda")
    assert MemoryBudget.parse(config.search.memory_budget).resolve(None) == 12 * GIB
    ranks.setenv(DEVICE_MEMORY_ENV, "10GiB")  # the setting, where tighter
    config, _ = budget.with_device_budget(study_config(tmp_path), "cuda")
    assert MemoryBudget.parse(config.search.memory_budget).resolve(None) == 10 * GIB


def test_a_budget_the_study_sets_and_the_cpu_are_left_as_they_are(tmp_path, ranks):
    ranks.setattr(budget, "device_of", lambda kind: pytest.fail("no device read"))
    given = study_config(tmp_path, memory_budget="+10%")
    assert budget.with_device_budget(given, "cuda") == (given, None)
    assert budget.with_device_budget(study_config(tmp_path), "cpu") == (study_config(tmp_path), None)


def test_a_bad_device_memory_setting_is_one_line(tmp_path, ranks):
    ranks.setattr(budget, "device_of", lambda kind: FakeCUDA())
    ranks.setenv(DEVICE_MEMORY_ENV, "most of it")
    with pytest.raises(PlannerError, match=f"^{DEVICE_MEMORY_ENV}='most of it': 'most of it' is not a size"):
        budget.with_device_budget(study_config(tmp_path), "cuda")
