"""The simulator's numeric kernel: one FSDP2 step over per-module arrays, compiled by numba.

Written as plain loops over NumPy arrays so numba can compile it
(``@njit``); without numba it runs as ordinary Python, same results. One
file per part, as FSDP2 splits its own: :mod:`~planner.simulation._kernel.state` (the
input bundles, the step's state and the names of its slots),
:mod:`~planner.simulation._kernel.timeline` (time and memory accounting),
:mod:`~planner.simulation._kernel.param_group` (unshard, wait, reshard, reduce-scatter)
and :mod:`~planner.simulation._kernel.hooks` (the hooks of one step, and
:func:`~planner.simulation._kernel.hooks.step`). ``planner.simulation.simulator`` is its only caller.
"""

import hashlib
from pathlib import Path


def drop_stale_numba_cache(here: Path = Path(__file__).parent) -> None:
    """Delete numba's cached machine code when any kernel source changed since it was compiled.

    numba's ``cache=True`` checks only the file of the function it loads: after
    an edit to a callee in another file (``param_group.py``), ``step`` would
    keep running the old callee. A digest of every kernel source is kept
    beside the cache; when it differs, the cache files go and numba compiles
    afresh. Best effort: a read-only install keeps its cache as it is.

    Args:
        here: the kernel's folder (its ``*.py`` and ``__pycache__``).
    """
    digest = hashlib.sha1(b"".join(f.read_bytes() for f in sorted(here.glob("*.py")))).hexdigest()
    cache = here / "__pycache__"
    stamp = cache / "kernel-sources.sha1"
    try:
        if stamp.exists() and stamp.read_text() == digest:
            return
        for f in [*cache.glob("*.nbi"), *cache.glob("*.nbc")]:
            f.unlink()
        cache.mkdir(exist_ok=True)
        stamp.write_text(digest)
    except OSError:
        pass


drop_stale_numba_cache()

from planner.simulation._kernel.hooks import step  # noqa: E402 - after the cache check
from planner.simulation._kernel.state import KernelParams, PlanArrays, ProfileArrays  # noqa: E402

__all__ = ["KernelParams", "PlanArrays", "ProfileArrays", "step"]
