"""This process's CPU time and page faults (``getrusage``): what a step cost the kernel as well as user space.

On a CPU device a step's tensors come from the C library's ``malloc``, and with glibc's a block freed above its
mmap threshold is faulted in again on the next step, and how much of that kernel work a step does depends on the
heap's state (docs/decisions/cpu-allocator.md). The recorder keeps the default step's share in the profile
(``InStepTimings``), so a report can say how much of the step it anchors on was the allocator's.
"""

from __future__ import annotations

import resource
from typing import NamedTuple


class ProcessUsage(NamedTuple):
    """This process's CPU ms in user space and in the kernel (every thread), and its minor page faults, so far
    (``getrusage(RUSAGE_SELF)``); ``after - before`` is what ran between. On a CPU device under glibc the kernel's
    ms are mostly page faults, each zeroing its page (docs/decisions/rule-evidence.md)."""

    user_ms: float
    system_ms: float
    faults: int

    @property
    def cpu_ms(self) -> float:
        """User and kernel ms together."""
        return self.user_ms + self.system_ms

    def __sub__(self, before: ProcessUsage) -> ProcessUsage:  # type: ignore[override]
        return ProcessUsage(self.user_ms - before.user_ms, self.system_ms - before.system_ms,
                            self.faults - before.faults)


def process_usage() -> ProcessUsage:
    """This process's usage so far (:class:`ProcessUsage`)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return ProcessUsage(r.ru_utime * 1e3, r.ru_stime * 1e3, r.ru_minflt)
