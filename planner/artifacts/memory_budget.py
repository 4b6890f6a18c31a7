"""The memory budget: a per-rank peak every plan the tool writes must stay within.

Written ``[search] memory_budget = "1.5GiB"`` (absolute) or ``"+150MiB"`` /
``"+10%"`` (above FSDP2's default's measured peak), or ``tune --memory-budget``.
The peak is per rank, max across ranks, as ``runtime.recording.peak_memory`` measures
it and ``planner.simulation.simulator`` predicts it (``SimResult.peak_bytes``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from planner.errors import MemoryBudgetError, StudyConfigError
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


def device_budget(free_bytes: int, reserved_bytes: int, total_bytes: int,
                  margin: float = DEVICE_MARGIN) -> MemoryBudget:
    """The in-loop tuner's budget on a CUDA device when none is given: what this process can still reach, its
    caching allocator's reserved bytes plus the device's free bytes (``torch.cuda.mem_get_info``,
    ``torch.cuda.memory_reserved``), less ``margin`` of the device's total. Absolute, per rank, as every budget is;
    never below zero. A budget FSDP2's default's own peak exceeds keeps the default: the isolated passes and every
    candidate are over it, so the tuner stops with the default applied (``planner.study.in_loop.isolation_groups``).
    """
    limit = max(0, int(reserved_bytes + free_bytes - margin * total_bytes))
    return MemoryBudget(f"{limit}B", float(limit), False, False)
