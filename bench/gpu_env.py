"""The GPU check's first stage: can this machine run the later stages? Fails fast, in one line.

    python3 -m bench.gpu_env --wheels .whl --site /tmp/gpu-two-ranks/site     # bench/gpu_two_ranks.sh's env stage

Installs the carried wheels (``bench/gpu_wheels.sh``) into a folder of their own, without an index, then imports
everything the later stages import (the project, its dependencies, the examples' libraries), then prints
torch, CUDA and NCCL, the route NCCL takes to two ranks on one GPU (``bench.shared_gpu``), and which of the
project's knobs the running torch lacks: those the planner then treats as unknown, never sampled on this torch
(``runtime.knob_state``). On any failure it prints one line, ``error: ...``, naming what is missing, and exits 2.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

# What the later stages import, in the order they need it: a missing one is named before anything runs.
STAGE_IMPORTS = ("torch", "torch.distributed.fsdp", "numpy", "scipy", "numba", "optuna", "pydantic", "sqlalchemy",
                 "alembic", "click", "tqdm", "filelock", "planner", "planner.study", "planner.simulation.simulator",
                 "runtime", "runtime.in_loop.autotuner", "runtime.recording.recorder", "jobs.cli", "bench.shared_gpu",
                 "bench.trace_profile", "bench.peak_memory")
# The examples' libraries: their stage is skipped where they are missing, and said so here.
OPTIONAL_IMPORTS = {"transformers": "hf", "accelerate": "hf", "torchtitan": "torchtitan"}
# The FSDP2 API every plan needs: without one of these nothing can be tuned on this torch.
NEEDED_API = ("fully_shard", "FSDPModule.set_modules_to_forward_prefetch",
              "FSDPModule.set_modules_to_backward_prefetch", "FSDPModule.set_reshard_after_forward",
              "FSDPModule.set_requires_gradient_sync", "FSDPModule.unshard", "FSDPModule.reshard")


def missing_imports(names: tuple[str, ...]) -> list[str]:
    """``"name: why"`` for each of ``names`` that does not import."""
    out = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any failure to import is what this stage reports
            out.append(f"{name}: {type(e).__name__}: {e}".splitlines()[0])
    return out


def missing_api() -> list[str]:
    """The FSDP2 API of :data:`NEEDED_API` the running torch lacks."""
    import torch.distributed.fsdp as fsdp

    out = []
    for path in NEEDED_API:
        owner, _, attr = path.rpartition(".")
        if not hasattr(getattr(fsdp, owner) if owner else fsdp, attr):
            out.append(path)
    return out


def lacking_knobs() -> list[str]:
    """``"knob (what is missing)"`` for each knob whose setter or state the running torch lacks."""
    from torch.distributed.fsdp import FSDPModule

    from planner.artifacts.knobs import KNOBS
    from runtime.apply import ROOT_SETTERS

    out = []
    for k in KNOBS:
        if not hasattr(FSDPModule, k.setter):
            out.append(f"{k.name} (no FSDPModule.{k.setter})")
        elif k.name in ROOT_SETTERS and k.setter.startswith("_") and not hasattr(FSDPModule, k.setter):
            out.append(f"{k.name} (no FSDPModule.{k.setter})")
    return out


def install(wheels: Path, site: Path) -> str | None:
    """The wheels of ``wheels`` installed into ``site`` (emptied first), which goes first on ``sys.path``; the error
    in one line, ``None`` when they installed (or there are none)."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        return None
    shutil.rmtree(site, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--no-cache-dir", "--target", str(site), *map(str, found)], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        return f"the carried wheels in {wheels}/ did not install: {last}"
    sys.path.insert(0, str(site))
    return None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, default=Path(".whl"), help="the carried wheels (bench/gpu_wheels.sh)")
    parser.add_argument("--site", type=Path, default=Path("/tmp/gpu-two-ranks/site"), help="where they install")
    args = parser.parse_args(argv)
    error = install(args.wheels, args.site)
    if error:
        print(f"error: {error}", flush=True)
        return 2
    failed = missing_imports(STAGE_IMPORTS)
    if failed:
        print(f"error: {failed[0]} ({len(failed)} missing: {', '.join(f.split(':')[0] for f in failed)}); carry the "
              "wheels: bash bench/gpu_wheels.sh where a registry is reachable, then run again with .whl/ in the tree",
              flush=True)
        return 2
    absent = missing_api()
    if absent:
        import torch

        print(f"error: torch {torch.__version__} lacks {absent[0]}, which every plan needs "
              f"({', '.join(absent)}); run on torch 2.11 or later", flush=True)
        return 2
    import torch

    from bench.shared_gpu import MULTI_RANK_GPU_NCCL

    cuda = torch.cuda.is_available()
    nccl = torch.cuda.nccl.version() if cuda else None
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
          + (f"{torch.cuda.get_device_name(0)}, NCCL {'.'.join(map(str, nccl))}" if cuda else "no GPU: gloo on CPU"))
    if cuda:
        route = ("NCCL_MULTI_RANK_GPU_ENABLE=1" if tuple(nccl) >= MULTI_RANK_GPU_NCCL
                 else "NCCL_HOSTID per rank, NCCL_SOCKET_IFNAME=lo")
        print(f"two ranks on one GPU: {route}")
    lacking = lacking_knobs()
    print(f"knobs this torch lacks (unknown, never sampled here): {', '.join(lacking) or 'none'}")
    skipped = sorted({stage for name, stage in OPTIONAL_IMPORTS.items() if missing_imports((name,))})
    print(f"stages skipped for a missing library: {', '.join(skipped) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
