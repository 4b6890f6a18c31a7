"""Starting ranks: ``torch.distributed.run`` (what ``torchrun`` runs) on this node.

``prefetch-planner tune STUDY.toml`` outside torchrun starts
``nproc_per_node`` ranks running the same command; under torchrun (``RANK``
and ``WORLD_SIZE`` set) the command runs as that rank. What each rank then
runs is a job (``jobs.tune``, ``jobs.profile``).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from runtime.ranks.allocator import rank_environment_set

if TYPE_CHECKING:
    from planner.artifacts.tables import LaunchTable


def in_torchrun() -> bool:
    """Whether this process is a rank started by torchrun (``RANK``/``WORLD_SIZE`` set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch_ranks(cli_args: list[str], launch: LaunchTable, module: str = "jobs.cli") -> int:
    """Run ``python -m <module> <cli_args>`` on local ranks (``jobs.cli``; a bench: ``bench.fidelity``).

    Uses ``torch.distributed.run`` with a standalone rendezvous on a free
    local port, the study's ``[launch]`` ``nproc_per_node`` ranks, one compute
    thread per rank (``OMP_NUM_THREADS=1``), under its ``allocator``
    (:mod:`runtime.ranks.allocator`).

    Returns:
        0 if every rank succeeded, 130 if the launcher was interrupted (the
        ranks get the signal too), else the first failing rank's exit code.

    Raises:
        StudyConfigError: the ``allocator`` is not installed.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={launch.nproc_per_node}", "--module", module, *cli_args]
    )
    try:
        with rank_environment_set(launch.allocator):
            run(args)
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        return next((c for c in codes if c), 1)
    except SignalException:  # Ctrl-C / SIGTERM: the ranks were signalled too and said what they did
        return 130
    return 0
