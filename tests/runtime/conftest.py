"""Helpers for multi-rank tests: real gloo ranks through torch.distributed.run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parents[1]


def rank_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def run_ranks(script: str, *args: str, nproc: int = 2, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``tests/runtime/ranks/<script>`` on ``nproc`` gloo ranks; raise on failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(HERE / "ranks" / script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=rank_env(), timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def run_cli(*args: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run ``prefetch-planner`` (as ``python -m jobs.cli``) in ``cwd``."""
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], capture_output=True, text=True,
                          env=rank_env(), timeout=timeout, cwd=cwd)


@pytest.fixture
def ranks():
    return run_ranks


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(scope="module")
def mesh():
    """A one-rank gloo process group in this process, and its CPU mesh (for FSDP2 models in unit tests)."""
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()
