"""The what-if against a measured step, as ``bench.layout_sweep`` and ``bench.link_sweep --profiles`` report it."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Checked:
    """One predicted step against the measured median.

    Attributes:
        error: predicted over measured, less 1.
        within: ``|error|`` at most the target's limit.
        inside: the band holds the measured median.
        cell: the table's cell: ``1569 ms, -9.0%, [1478, 1959] holds``.
    """

    error: float
    within: bool
    inside: bool
    cell: str


def checked(step_ms: float, low_ms: float, high_ms: float, measured_ms: float, limit: float) -> Checked:
    """``step_ms`` with its band ``[low_ms, high_ms]`` against ``measured_ms`` (ms), within ``limit`` (a fraction)."""
    error = step_ms / measured_ms - 1
    within, inside = abs(error) <= limit, low_ms <= measured_ms <= high_ms
    return Checked(error, within, inside, f"{step_ms:.0f} ms, {error:+.1%}{'' if within else ' (**outside**)'}, "
                   f"[{low_ms:.0f}, {high_ms:.0f}] {'holds' if inside else '**misses**'}")


def largest_from_mean(values: list[float]) -> float:
    """How far the farthest of ``values`` lies from their mean, a fraction: the predictions' spread over profiles."""
    mean = statistics.fmean(values)
    return max(abs(v / mean - 1) for v in values)
