"""The memory budget: a per-rank peak every plan the tool writes must stay within.

Written ``[search] memory_budget = "1.5GiB"`` (absolute) or ``"+150MiB"`` /
``"+10%"`` (above FSDP2's default's measured peak), or ``tune --memory-budget``.
The peak is per rank, max across ranks, as ``runtime.recording.peak_memory`` measures
it and ``planner.simulation.simulator`` predicts it (``SimResult.peak_bytes``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from planner.errors import MemoryBudgetError, PlannerError, StudyConfigError
from planner.units import mib, parse_bytes

_PERCENT = re.compile(r"^\s*\+\s*(\d+(?:\.\d+)?)\s*%\s*$")


@dataclass(frozen=True)
class MemoryBudget:
    """A parsed budget.

    Attributes:
        text: as written.
        value: bytes (absolute or added), or percent when ``percent``.
        relative: above FSDP2's default's measured peak.
        percent: ``value`` is a percentage of that peak.
    """

    text: str
    value: float
    relative: bool
    percent: bool

    @staticmethod
    def error(text: str) -> str | None:
        """Why ``text`` is not a budget (one line), ``None`` if it is one."""
        try:
            MemoryBudget.parse(text)
        except StudyConfigError as e:
            return str(e)
        return None

    @classmethod
    def parse(cls, text: str) -> MemoryBudget:
        """Parse ``"1.5GiB"``, ``"+150MiB"`` or ``"+10%"``.

        Raises:
            StudyConfigError: any other form (one line, with the three forms).
        """
        refused = StudyConfigError(
            f"memory budget {text!r} is not understood; write an absolute peak per rank (\"1.5GiB\") or one "
            f"relative to FSDP2's default's measured peak (\"+150MiB\", \"+10%\")")
        if not isinstance(text, str):
            raise refused
        if m := _PERCENT.match(text):
            return cls(text.strip(), float(m.group(1)), True, True)
        relative = text.strip().startswith("+")
        try:
            return cls(text.strip(), float(parse_bytes(text.strip().removeprefix("+"))), relative, False)
        except ValueError:
            raise refused from None

    def resolve(self, default_peak_bytes: int | None) -> int:
        """The budget in bytes.

        Args:
            default_peak_bytes: FSDP2's default's measured peak (``Profile.measured_peak_bytes``).

        Raises:
            MemoryBudgetError: a relative budget and no measured peak to add it to.
        """
        if not self.relative:
            return int(self.value)
        if default_peak_bytes is None:
            raise MemoryBudgetError(
                f"memory budget {self.text!r} is relative to FSDP2's default's measured peak, which this profile "
                "lacks; record the profile again, or give an absolute budget such as \"1.5GiB\"")
        if self.percent:
            return int(default_peak_bytes * (1 + self.value / 100))
        return int(default_peak_bytes + self.value)


def check_feasible(memory_budget_bytes: int, smallest_predicted_bytes: int, text: str) -> None:
    """Raise when no plan can fit.

    Raises:
        MemoryBudgetError: ``memory_budget_bytes < smallest_predicted_bytes``; names both, in MiB.
    """
    if memory_budget_bytes < smallest_predicted_bytes:
        raise MemoryBudgetError(
            f"memory budget {text} ({mib(memory_budget_bytes)}) is below the smallest predicted peak of any plan "
            f"({mib(smallest_predicted_bytes)}, FSDP2's default with no prefetch); raise the budget")



# The share of a CUDA device's memory the in-loop tuner's default budget leaves free: the caching allocator's
# fragmentation (a peak of allocated bytes needs more reserved) and what the user's job may still grow by (a longer
# batch, an evaluation step) after the tuner has measured it.
DEVICE_MARGIN = 0.10


def device_budget(free_bytes: int, reserved_bytes: int, total_bytes: int, fraction: float = 1.0,
                  margin: float = DEVICE_MARGIN) -> MemoryBudget:
    """The budget on a CUDA device when none is given (``tune`` and the in-loop tuner alike): what this process can
    still reach, its caching allocator's reserved bytes plus the device's free bytes (``torch.cuda.mem_get_info``,
    ``torch.cuda.memory_reserved``), at most the share ``fraction`` of the device's total the process is held to
    (``torch.cuda.set_per_process_memory_fraction``: the allocator refuses past it), less ``margin`` of the device's
    total. Absolute, per rank, as every budget is; never below zero. A budget FSDP2's default's own peak exceeds
    keeps the default: the isolated passes and every candidate are over it, so the tuner stops with the default
    applied (``planner.study.isolation.isolation_groups``).
    """
    reachable = min(reserved_bytes + free_bytes, fraction * total_bytes)
    limit = max(0, int(reachable - margin * total_bytes))
    return MemoryBudget(f"{limit}B", float(limit), False, False)


# [Note: NCCL's buffers outside the caching allocator]
# Every NCCL communicator allocates its own device buffers through cudaMalloc, outside PyTorch's caching allocator,
# so neither the recorder's peaks nor the simulator's see them: per channel and peer, NCCL_BUFFSIZE (4 MiB by
# default) for the Simple protocol, and smaller LL and LL128 buffers, for ring and tree (NCCL's docs, "Environment
# Variables": NCCL_BUFFSIZE, NCCL_MAX_NCHANNELS). A plan that adds a communicator (FSDP2's
# set_separate_reduce_scatter_group: the reduce-scatter's own group, built at the first backward) adds those
# buffers. The allowance below is stated, not measured: 4 MiB x 2 directions x 32 channels x 2 algorithms. NVLS
# (Hopper's NVLink SHARP, NCCL_NVLS_ENABLE) allocates more and is not counted: set [search] memory_budget there.
NCCL_COMMUNICATOR_BYTES = (4 * 2 * 32 * 2) << 20


def added_communicators(plan: Any) -> int:
    """The NCCL communicators a plan builds beyond FSDP2's default's: one where the reduce-scatter has its own
    process group (``separate_reduce_scatter_group``)."""
    return 1 if plan.separate_reduce_scatter_group else 0


@dataclass(frozen=True)
class PeakBudget:
    """What a candidate's predicted peak must fit under, per rank, in bytes ([Note: NCCL's buffers outside the
    caching allocator]).

    Attributes:
        limit_bytes: the job's memory budget.
        error_bytes: the simulator's error on the job's own baseline, what FSDP2's default measured over what it
            was predicted at (never below zero): added to every candidate's predicted peak.
        communicator_bytes: the allowance for each NCCL communicator a plan adds (:data:`NCCL_COMMUNICATOR_BYTES`
            on CUDA; 0 on gloo, whose buffers are host memory the peaks already count).
    """

    limit_bytes: int
    error_bytes: int = 0
    communicator_bytes: int = 0

    def charged(self, plan: Any, peak_bytes: int, predicted: bool = True) -> int:
        """The bytes ``plan`` is charged at ``peak_bytes`` (predicted, or measured by the caching allocator: then
        without the simulator's error)."""
        return peak_bytes + (self.error_bytes if predicted else 0) + self.communicator_bytes * added_communicators(plan)

    def admits(self, plan: Any, peak_bytes: int, predicted: bool = True) -> bool:
        """Whether ``plan`` at ``peak_bytes`` fits (:meth:`charged` within :attr:`limit_bytes`)."""
        return self.charged(plan, peak_bytes, predicted) <= self.limit_bytes


DEVICE_MEMORY_ENV = "PREFETCH_PLANNER_DEVICE_MEMORY"
"""The setting that caps the device memory a rank may reach, bytes (``"2GiB"``): on CPU the only device limit the
isolated passes have, on CUDA the tighter of it and the device's own."""


def device_memory_cap(environ: Mapping[str, str] = os.environ) -> int | None:
    """The cap :data:`DEVICE_MEMORY_ENV` sets, bytes per rank; ``None``: unset.

    Raises:
        PlannerError: it is set but not a size.
    """
    text = environ.get(DEVICE_MEMORY_ENV, "").strip()
    if not text:
        return None
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise PlannerError(f"{DEVICE_MEMORY_ENV}={text!r}: {e}") from None
