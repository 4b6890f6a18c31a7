"""Two NCCL ranks on one GPU: each torchrun rank made a node of its own, then a module or script run in it.

    torchrun --standalone --nproc-per-node 2 -m bench.shared_gpu jobs.cli tune bench/llama-gpu-two-ranks.toml
    torchrun --standalone --nproc-per-node 2 -m bench.shared_gpu docs/examples/plain_loop.py --quick

NCCL refuses two ranks on one GPU ("Duplicate GPU detected") when their host hashes match. By NCCL version:

- 2.30 or later: ``NCCL_MULTI_RANK_GPU_ENABLE=1``, NCCL's own (experimental) support for up to 2 ranks a GPU;
- earlier (the GPU test machines' 2.28.9): a different ``NCCL_HOSTID`` per rank and ``NCCL_SOCKET_IFNAME=lo``:
  NCCL sees two hosts and talks over loopback sockets (unofficial; a third-party report measured about 2.6 GB/s).

Each rank is told it is the only rank of its node (``LOCAL_RANK=0``, ``LOCAL_WORLD_SIZE=1``), so it takes GPU 0 as a
one-GPU node would, and each process's memory is capped (``torch.cuda.set_per_process_memory_fraction``,
``SHARED_GPU_MEMORY_FRACTION``, default 0.45) so that two fit. The two processes time-slice the GPU's compute, so
their step times are not a cluster's; the collectives are real NCCL kernels on FSDP2's own streams.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Mapping

MULTI_RANK_GPU_NCCL = (2, 30, 0)  # NCCL_MULTI_RANK_GPU_ENABLE's first release
DEFAULT_MEMORY_FRACTION = 0.45


def shared_gpu_env(environ: Mapping[str, str], nccl_version: tuple[int, ...]) -> dict[str, str]:
    """The variables that let this rank share GPU 0 with the other rank(s) of its torchrun, for ``nccl_version``.

    Raises:
        ValueError: not a torchrun rank (``RANK`` unset).
    """
    if "RANK" not in environ:
        raise ValueError("bench.shared_gpu runs as a torchrun rank: torchrun --nproc-per-node 2 -m bench.shared_gpu")
    env = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    if tuple(nccl_version) >= MULTI_RANK_GPU_NCCL:
        env["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    else:
        env["NCCL_HOSTID"] = f"shared-gpu-rank-{environ['RANK']}"
        env["NCCL_SOCKET_IFNAME"] = "lo"
    return env


def memory_fraction(environ: Mapping[str, str]) -> float:
    """Each process's share of the GPU's memory (``SHARED_GPU_MEMORY_FRACTION``).

    Raises:
        ValueError: not a number in (0, 0.5].
    """
    text = environ.get("SHARED_GPU_MEMORY_FRACTION", str(DEFAULT_MEMORY_FRACTION))
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 0.5:
        raise ValueError(f"SHARED_GPU_MEMORY_FRACTION={text!r}: give a fraction in (0, 0.5], two ranks share the GPU")
    return value


def main(argv: list[str]) -> None:
    """Set this rank up on the shared GPU, then run ``argv``: a ``.py`` script, else ``MODULE ARGS...``."""
    if not argv:
        sys.exit("usage: torchrun --nproc-per-node 2 -m bench.shared_gpu MODULE|SCRIPT.py [ARGS...]")
    import torch

    if torch.cuda.is_available():
        os.environ.update(shared_gpu_env(os.environ, torch.cuda.nccl.version()))
        torch.cuda.set_per_process_memory_fraction(memory_fraction(os.environ), 0)
    else:  # no GPU (the project's CPU tests): each rank a node of its own all the same, on gloo
        os.environ.update(shared_gpu_env(os.environ, ()))
    sys.argv = list(argv)
    if argv[0].endswith(".py"):
        runpy.run_path(argv[0], run_name="__main__")
    else:
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
