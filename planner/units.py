"""How sizes, rates and durations are written and read: one formatter each, used by every report, table and error
message, and one parser each, used by every file and option that takes one.

Units are case-sensitive, as written in the docs: a size is ``B``, ``KB``/``MB``/``GB``/``TB`` (decimal) or
``KiB``/``MiB``/``GiB``/``TiB`` (binary), its value from ``pydantic.ByteSize``; a rate is a size or ``bit`` with an SI
prefix, per second. ``pydantic.ByteSize`` alone would read ``"1Gb"`` as a gigabyte, which a network engineer means
as a gigabit: the unit is matched exactly first.
"""

from __future__ import annotations

import re

MIB = 2**20  # bytes in a MiB

_SIZE = re.compile(r"^\s*(\d*\.?\d+)\s*([KMGT]i?B|B)\s*$")
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([KMGT]?)(bit|B)/s\s*$")
_TIME = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ns|us|ms|s)\s*$")
_PERCENT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")
SIZE_UNITS = "B; KB, MB, GB, TB (powers of 1000); KiB, MiB, GiB, TiB (powers of 1024)"
_PREFIX = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_bytes(text: str) -> int:
    """``"1.5GiB"`` -> 1610612736: a number and a byte unit (see the module docstring), through ``pydantic.ByteSize``.

    Raises:
        ValueError: no number, or no unit, or another unit (the message names the input).
    """
    from pydantic import ByteSize, TypeAdapter

    m = _SIZE.match(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"{text!r} is not a size: write a number with its unit, e.g. '1.5GiB' or '150MB'; units "
                         f"are case-sensitive: {SIZE_UNITS}")
    return int(TypeAdapter(ByteSize).validate_python(f"{m.group(1)}{m.group(2)}"))


def parse_rate(text: str) -> float:
    """``"1Gbit/s"`` -> 1.25e8 bytes per second (SI prefixes K, M, G, T on ``bit/s`` or ``B/s``).

    Raises:
        ValueError: no number, not positive, or a unit other than those.
    """
    m = _RATE.match(text) if isinstance(text, str) else None
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"bandwidth {text!r}: write a positive number with its unit, e.g. '1Gbit/s', '400Mbit/s' or "
                         "'25GB/s'; units are case-sensitive: bit/s or B/s, after K, M, G or T (powers of 1000)")
    return float(m.group(1)) * _PREFIX[m.group(2)] / (8.0 if m.group(3) == "bit" else 1.0)


def parse_seconds(text: str) -> float:
    """``"50us"`` -> 5e-05 (units ns, us, ms, s).

    Raises:
        ValueError: no number, or another unit.
    """
    m = _TIME.match(text)
    if not m:
        raise ValueError(f"latency {text!r}: write a number with its unit, e.g. '50us', '2ms'; units are "
                         "case-sensitive: ns, us, ms or s")
    return float(m.group(1)) * _SECONDS[m.group(2)]


def parse_percent(text: str) -> float:
    """``"10%"`` -> 0.1.

    Raises:
        ValueError: not a number from 0 to 100 (100 excluded) followed by ``%``.
    """
    m = _PERCENT.match(text)
    if not m or not 0 <= float(m.group(1)) < 100:
        raise ValueError(f"spread {text!r}: write a percentage from 0 to 100, e.g. '10%'")
    return float(m.group(1)) / 100


def count(n: int, noun: str) -> str:
    """``count(1, "rank")`` -> ``"1 rank"``, ``count(4, "rank")`` -> ``"4 ranks"`` (nouns whose plural adds an s)."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


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
