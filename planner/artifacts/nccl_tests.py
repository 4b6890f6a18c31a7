"""A link's bus bandwidth by message size, read from the output of NVIDIA's nccl-tests (``nccl_tests = "FILE"``).

[Note: Reading nccl-tests]
``all_gather_perf`` (and its siblings) print one row per message size::

    #       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
    #        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
         1048576        262144     float    none      -1    45.12   23.24   20.33      0    44.98   23.31   20.40      0

``size`` is the collective's whole buffer in bytes (an all-gather's output),
``busbw`` is ``algbw`` times the ring's share on the wire (``(n - 1) / n`` for an
all-gather or reduce-scatter, ``2 (n - 1) / n`` for an all-reduce; nccl-tests'
``PERFORMANCE.md``), in GB/s (10^9 bytes per second). So a call of a buffer of
``size`` bytes takes ``wire bytes / busbw``: exactly how a target's
``bandwidth`` is used. The out-of-place ``busbw`` (the first of the two) is read;
between two sizes the bandwidth is interpolated on log-log axes, and outside
the file's sizes the nearest row's bandwidth is held (no extrapolation of a
curve's slope). Rows whose ``#wrong`` is not 0 are refused: the run was broken.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BusBandwidthCurve:
    """Bus bandwidth by message size ([Note: Reading nccl-tests]).

    Attributes:
        sizes: message sizes, bytes, increasing.
        bytes_per_s: the out-of-place bus bandwidth at each size, bytes per second.
        source: the file it was read from.
    """

    sizes: tuple[int, ...]
    bytes_per_s: tuple[float, ...]
    source: str

    def at(self, size: float) -> float:
        """The bus bandwidth for a buffer of ``size`` bytes, bytes per second: log-log interpolation, held at
        the ends."""
        if size <= self.sizes[0]:
            return self.bytes_per_s[0]
        if size >= self.sizes[-1]:
            return self.bytes_per_s[-1]
        i = bisect.bisect_right(self.sizes, size)
        x0, x1 = math.log(self.sizes[i - 1]), math.log(self.sizes[i])
        y0, y1 = math.log(self.bytes_per_s[i - 1]), math.log(self.bytes_per_s[i])
        return math.exp(y0 + (y1 - y0) * (math.log(size) - x0) / (x1 - x0))

    @property
    def peak(self) -> float:
        """The highest bus bandwidth in the file, bytes per second."""
        return max(self.bytes_per_s)

    def describe(self) -> str:
        """``nccl-tests all_gather.txt: 12 sizes 1.0 MB-4.3 GB, bus bandwidth 20.3-362.1 GB/s``."""
        return (f"nccl-tests {Path(self.source).name}: {len(self.sizes)} sizes {self.sizes[0] / 1e6:.1f} MB-"
                f"{self.sizes[-1] / 1e6:.1f} MB, bus bandwidth {min(self.bytes_per_s) / 1e9:.1f}-"
                f"{self.peak / 1e9:.1f} GB/s")


def read_nccl_tests(path: str | Path) -> BusBandwidthCurve:
    """Read an nccl-tests output file ([Note: Reading nccl-tests]).

    Raises:
        ValueError: the file cannot be read, has no result row, has a row with wrong results, or sizes that do not
            increase (one line naming the file and the fix).
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"nccl_tests file {str(path)!r}: {e.strerror}; give the path of the output of "
                         "all_gather_perf (relative to the target file)") from None
    sizes: list[int] = []
    rates: list[float] = []
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or line.lstrip().startswith("#") or not fields[0].isdigit() or len(fields) < 9:
            continue
        try:
            size, busbw, wrong = int(fields[0]), float(fields[7]), fields[8]
        except ValueError:
            raise ValueError(f"nccl_tests file {str(path)!r} line {n}: not an nccl-tests result row (size ... time "
                             "algbw busbw #wrong); paste the output of all_gather_perf unchanged") from None
        if wrong not in ("0", "N/A"):
            raise ValueError(f"nccl_tests file {str(path)!r} line {n}: #wrong is {wrong}: that run gave wrong "
                             "results; fix the cluster and run nccl-tests again")
        if size <= 0 or busbw <= 0:
            continue
        sizes.append(size)
        rates.append(busbw * 1e9)
    if not sizes:
        raise ValueError(f"nccl_tests file {str(path)!r} has no result row with a positive size and bus bandwidth; "
                         "give the output of all_gather_perf -b 1M -e 1G -f 2 (or wider)")
    if any(b <= a for a, b in zip(sizes, sizes[1:], strict=False)):
        raise ValueError(f"nccl_tests file {str(path)!r}: the sizes do not increase; give one run's output")
    return BusBandwidthCurve(tuple(sizes), tuple(rates), str(path))
