"""Multi-rank tests' helpers: real gloo ranks through ``torch.distributed.run``, and the CLI in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]
RANK_SCRIPTS = ROOT / "tests" / "runtime" / "rank_scripts"


def rank_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(RANK_SCRIPTS.parent), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def run_ranks(script: str, *args: str, nproc: int = 2, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``tests/runtime/rank_scripts/<script>`` on ``nproc`` gloo ranks; raise on failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(RANK_SCRIPTS / script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=rank_env(), timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def run_cli(*args: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run ``prefetch-planner`` (as ``python -m jobs.cli``) in ``cwd``."""
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], capture_output=True, text=True,
                          env=rank_env(), timeout=timeout, cwd=cwd)


def end_rank() -> NoReturn:
    """End an adapter's rank script once its figures are written: the process groups destroyed, the output flushed,
    and the process left without the interpreter's finalization (``os._exit(0)``).

    A trainer, its model and its device mesh hold the process groups past ``destroy_process_group()``; their C++
    objects then go during finalization, and gloo's threads holding work with Python references abort the process
    now and then ("terminate called without an active exception", SIGABRT; pytorch/pytorch#179291 describes the
    mechanism), after the rank has written its figures, on the plain trainer as on the tuned one.
    """
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
