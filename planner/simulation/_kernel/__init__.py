"""The simulator's numeric kernel: one FSDP2 step over per-module arrays, compiled by numba.

Written as plain loops over NumPy arrays so numba can compile it
(``@njit``); without numba it runs as ordinary Python, same results. One
file per part, as FSDP2 splits its own: :mod:`~planner.simulation._kernel.state`
(the input bundles, the step's state and the names of its slots),
:mod:`~planner.simulation._kernel.timeline` (time and memory accounting),
:mod:`~planner.simulation._kernel.param_group` (unshard, wait, reshard,
reduce-scatter) and :mod:`~planner.simulation._kernel.hooks` (the hooks of one
step). :class:`planner.simulation.simulator.Simulator` is its only caller,
through :func:`step_function`.

[Note: The kernel's numba cache]
numba's ``cache=True`` checks only the file of the function it loads: after an
edit to a callee in another file (``param_group.py``), ``step`` would keep
running the old callee, and a knob's position (``planner.artifacts.knobs``)
is folded in as a constant. So a digest of every kernel source and of the
knob declarations is kept beside the cache, and when it differs the cache files go and numba compiles afresh. The
check runs once per process, before the first compile (:func:`step_function`),
not at import, under an exclusive lock (``filelock``) on a file beside the cache: ranks
started together wait for one another instead of deleting the files another
is loading. numba itself writes its cache files by atomic rename. Best
effort: where the folder cannot be written (a read-only install), the cache
stays as it is.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path

import filelock

from planner.artifacts import knobs
from planner.simulation._kernel.hooks import step
from planner.simulation._kernel.state import KernelParams, PlanArrays, ProfileArrays

__all__ = ["KernelParams", "PlanArrays", "ProfileArrays", "drop_stale_numba_cache", "step_function"]

HERE = Path(__file__).parent


def sources_digest(here: Path = HERE) -> str:
    """SHA-1 of every kernel source file, in name order, and of the knob declarations the kernel reads."""
    files = [*sorted(here.glob("*.py")), Path(knobs.__file__)]
    return hashlib.sha1(b"".join(f.read_bytes() for f in files)).hexdigest()


def drop_stale_numba_cache(here: Path = HERE) -> bool:
    """Delete numba's cached machine code if any kernel source changed since it was compiled ([Note: The kernel's
    numba cache]).

    Args:
        here: the kernel's folder (its ``*.py`` and ``__pycache__``).

    Returns:
        Whether cache files were stale (and deleted, where the folder is writable).
    """
    digest = sources_digest(here)
    cache = here / "__pycache__"
    stamp = cache / "kernel-sources.sha1"
    try:
        if stamp.exists() and stamp.read_text() == digest:
            return False
        for f in [*cache.glob("*.nbi"), *cache.glob("*.nbc")]:
            f.unlink()
        cache.mkdir(exist_ok=True)
        stamp.write_text(digest)
    except OSError:
        pass
    return True


@contextlib.contextmanager
def cache_lock(here: Path = HERE) -> Iterator[None]:
    """Hold an exclusive lock on ``__pycache__/kernel.lock`` (``filelock.FileLock``); no lock where it cannot be
    made."""
    try:
        (here / "__pycache__").mkdir(exist_ok=True)
        lock = filelock.FileLock(here / "__pycache__" / "kernel.lock")
        lock.acquire()
    except OSError:
        yield
        return
    try:
        yield
    finally:
        lock.release()


@functools.cache
def step_function() -> Callable[..., tuple]:
    """The compiled ``step`` (:func:`planner.simulation._kernel.hooks.step`), its cache checked first.

    Once per process: the first call checks numba's cache under the lock
    ([Note: The kernel's numba cache]); numba then compiles, or loads the
    cached code, on the first step.
    """
    with cache_lock():
        drop_stale_numba_cache()
    return step
