"""How sizes and durations are written: one formatter each, used by every report, table and error message."""

from __future__ import annotations

MIB = 2**20  # bytes in a MiB


def mib(n: int | float | None, digits: int = 1, unit: bool = True) -> str:
    """Bytes as MiB: ``"1234.5 MiB"``; ``unit=False``: ``"1234.5"`` (a column headed MiB); ``"-"`` for ``None``."""
    if n is None:
        return "-"
    return f"{n / MIB:.{digits}f}" + (" MiB" if unit else "")


def ms(x: float | None, digits: int = 1, unit: bool = False) -> str:
    """Milliseconds: ``"12.3"`` (a column headed ms); ``unit=True``: ``"12.3 ms"``; ``"-"`` for ``None``."""
    if x is None:
        return "-"
    return f"{x:.{digits}f}" + (" ms" if unit else "")
