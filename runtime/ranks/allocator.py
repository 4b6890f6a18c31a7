"""The ranks' CPU memory allocator (``[launch] allocator``): the environment that preloads it, and the check a rank
makes that it runs under the one the study names.

On CPU a step's tensors come from the C library's ``malloc``. glibc hands blocks above its mmap threshold (at most
32 MiB) back to the kernel when they are freed, so every step faults them in again, and whether the heap has room
for a block depends on what the process freed before: a step's page faults, and so its kernel time, move with what
ran before it in the process (docs/decisions/cpu-allocator.md). jemalloc told never to return
a page (:data:`JEMALLOC_CONF`) takes none after the first steps, as PyTorch's caching allocator on a GPU calls no
``cudaMalloc`` once warm. PyTorch's own CPU launcher preloads jemalloc the same way
(``torch.backends.xeon.run_cpu --enable-jemalloc``).
"""

from __future__ import annotations

import contextlib
import ctypes.util
import os
from collections.abc import Iterator
from pathlib import Path

from planner.artifacts.names import Allocator
from planner.errors import StudyConfigError

JEMALLOC_CONF = "oversize_threshold:0,dirty_decay_ms:-1,muzzy_decay_ms:-1"
"""jemalloc's options for the ranks: no dedicated arena for large blocks, and freed pages are never returned to the
kernel (``dirty_decay_ms``/``muzzy_decay_ms`` -1). A rank's resident memory stays at its high-water mark. A
``MALLOC_CONF`` already in the environment is kept."""

_INSTALL = "Debian/Ubuntu: apt-get install libjemalloc2; conda: conda install -c conda-forge jemalloc"


def jemalloc_library() -> str:
    """The jemalloc shared library's name as the dynamic linker finds it (e.g. ``libjemalloc.so.2``).

    Raises:
        StudyConfigError: jemalloc is not installed where the dynamic linker looks.
    """
    found = ctypes.util.find_library("jemalloc")
    if found is None:
        raise StudyConfigError(f"[launch] allocator = 'jemalloc' needs jemalloc on this machine, and the dynamic "
                               f"linker finds none ({_INSTALL}); or set allocator = 'system'")
    return found


def rank_environment(allocator: Allocator | str) -> dict[str, str]:
    """The variables to set for the ranks' processes so they run under ``allocator`` (empty for ``system``).

    Raises:
        StudyConfigError: ``jemalloc`` and it is not installed (:func:`jemalloc_library`).
    """
    if Allocator(allocator) == Allocator.SYSTEM:
        return {}
    preload = " ".join(p for p in (jemalloc_library(), os.environ.get("LD_PRELOAD", "")) if p)
    return {"LD_PRELOAD": preload, "MALLOC_CONF": os.environ.get("MALLOC_CONF", JEMALLOC_CONF)}


@contextlib.contextmanager
def rank_environment_set(allocator: Allocator | str) -> Iterator[None]:
    """Inside the block ``os.environ`` holds :func:`rank_environment` (what processes started there inherit);
    restored on leaving.

    Raises:
        StudyConfigError: as :func:`rank_environment`.
    """
    changes = rank_environment(allocator)
    before = {key: os.environ.get(key) for key in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def loaded_allocator(maps: Path = Path("/proc/self/maps")) -> Allocator:
    """The allocator this process runs under: ``jemalloc`` if its library is mapped, else ``system``.

    Where ``maps`` cannot be read (not Linux) it says ``system``.
    """
    try:
        text = maps.read_text()
    except OSError:
        return Allocator.SYSTEM
    return Allocator.JEMALLOC if "libjemalloc" in text else Allocator.SYSTEM


def check_rank_allocator(allocator: Allocator | str) -> None:
    """Refuse a rank that runs under another allocator than the study names (e.g. started by hand with torchrun).

    Raises:
        StudyConfigError: naming the allocator found, and how to start the rank or what to set instead.
    """
    wanted, running = Allocator(allocator), loaded_allocator()
    if wanted == running:
        return
    if wanted == Allocator.JEMALLOC:
        raise StudyConfigError(f"[launch] allocator = 'jemalloc', but this rank runs without it: start torchrun "
                               f"with LD_PRELOAD={jemalloc_library()} MALLOC_CONF={JEMALLOC_CONF}, or set "
                               "allocator = 'system'")
    raise StudyConfigError("[launch] allocator = 'system', but this rank runs with jemalloc preloaded (LD_PRELOAD): "
                           "set allocator = 'jemalloc', or start the ranks without LD_PRELOAD")
