"""One rank's lifecycle: check the machine, join the process group, leave it cleanly."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from planner.artifacts.names import Allocator, Backend
from planner.artifacts.tables import LaunchTable
from planner.errors import StudyConfigError
from runtime.ranks.allocator import check_rank_allocator, jemalloc_library
from runtime.ranks.device import device_of


def check_runnable(backend: Backend | str, ranks_per_node: int,
                   allocator: Allocator | str = Allocator.SYSTEM, mesh: Sequence[int] | None = None,
                   tensor_parallel: int = 1) -> None:
    """Refuse a study this machine cannot run, before any rank starts.

    ``nccl`` needs one CUDA device per rank on the node; ``gloo`` runs
    anywhere; ``jemalloc`` must be installed; an HSDP ``mesh`` must hold the ranks the launcher starts (a rank
    started by torchrun, whose job may span nodes, checks it in :func:`init_rank` against the job's world size).

    Args:
        backend: ``[launch] backend``.
        ranks_per_node: ranks this node will run (``[launch] nproc_per_node``,
            or torchrun's ``LOCAL_WORLD_SIZE``).
        allocator: ``[launch] allocator``.
        mesh: ``[launch] mesh``.
        tensor_parallel: ``[launch] tensor_parallel``.

    Raises:
        StudyConfigError: naming the key and what to set instead.
    """
    if Allocator(allocator) == Allocator.JEMALLOC:
        jemalloc_library()  # refuses a machine without it
    check_mesh(mesh, ranks_per_node, tensor_parallel)  # from the launcher, whose job is its nproc_per_node ranks
    if Backend(backend) != Backend.NCCL:
        return
    if not torch.cuda.is_available():
        raise StudyConfigError(
            f"[launch] backend = 'nccl' needs CUDA GPUs, and torch {torch.__version__} sees none on this machine; "
            "set backend = 'gloo' to run on CPU, or run the study on a GPU node"
        )
    gpus = torch.cuda.device_count()
    if ranks_per_node > gpus:
        raise StudyConfigError(
            f"[launch] nproc_per_node = {ranks_per_node} with backend = 'nccl' needs a GPU per rank, and this "
            f"machine has {gpus}; set nproc_per_node = {gpus} (or torchrun --nproc-per-node {gpus})"
        )


def check_mesh(mesh: Sequence[int] | None, world_size: int, tensor_parallel: int = 1) -> None:
    """An HSDP mesh ``[replicate, shard]`` must hold every rank of the job; a tensor-parallel degree must divide it.

    Raises:
        StudyConfigError: its product is not ``world_size``; ``tensor_parallel`` does not divide ``world_size``.
    """
    if world_size % tensor_parallel:
        raise StudyConfigError(f"[launch] tensor_parallel = {tensor_parallel} does not divide this job's "
                               f"{world_size} ranks; set a divisor of the ranks per node")
    if mesh is not None and mesh[0] * mesh[1] != world_size:
        raise StudyConfigError(f"[launch] mesh {list(mesh)} has {mesh[0] * mesh[1]} ranks, this job has {world_size}; "
                               "write mesh = [replicate, shard] with replicate x shard = the job's ranks")


def init_rank(backend: Backend | str, timeout_s: float = 900.0, allocator: Allocator | str | None = None,
              mesh: Sequence[int] | None = None, tensor_parallel: int = 1) -> DeviceMesh:
    """Initialize the process group and the device mesh: 1-D over every rank, HSDP's 2-D ``mesh``
    (``[replicate, shard]``, dims named ``"replicate"`` and ``"shard"``: ``fully_shard`` on it shards within a shard
    group and replicates across them), or under ``tensor_parallel`` > 1 FSDP + TP's ``(dp, tp)`` (dims named
    ``"dp"`` and ``"tp"``, the TP ranks consecutive: within a node, as torchtitan's ``ParallelDims`` lays them).

    ``timeout_s`` bounds every collective of the process group (a rank waits
    at most that long for its peers). On CPU, one compute thread per rank
    (``torch.set_num_threads(1)``). ``allocator`` (``[launch] allocator``):
    the rank must run under it; ``None``: not checked.

    Raises:
        StudyConfigError: the machine cannot run ``backend`` with this many
            ranks per node (:func:`check_runnable`), the rank runs under
            another allocator (:func:`runtime.ranks.allocator.check_rank_allocator`), or ``mesh`` does not hold
            every rank, or ``tensor_parallel`` does not divide the ranks (:func:`check_mesh`).
    """
    backend = Backend(backend)
    check_runnable(backend, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if allocator is not None:
        check_rank_allocator(allocator)
    device = "cuda" if backend == Backend.NCCL else "cpu"
    device_id = None
    if device == "cpu":
        torch.set_num_threads(1)
    else:  # the rank's GPU before NCCL starts; device_id binds the communicator to it (no rank lands on cuda:0)
        device_id = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device_id)
    if not dist.is_initialized():
        dist.init_process_group(str(backend), timeout=datetime.timedelta(seconds=timeout_s), device_id=device_id)
    check_mesh(mesh, dist.get_world_size(), tensor_parallel)
    return job_mesh(device, dist.get_world_size(), mesh, tensor_parallel)


def job_mesh(device: str, world_size: int, mesh: Sequence[int] | None = None, tensor_parallel: int = 1) -> DeviceMesh:
    """The device mesh a job's workload shards over (the process group initialized): 1-D over ``world_size``
    ranks, HSDP's ``(replicate, shard)`` ``mesh``, or FSDP + TP's ``(world_size // tensor_parallel,
    tensor_parallel)`` with dims ``"dp"`` and ``"tp"``; the same in a rank (:func:`init_rank`) and on a fake world
    (``runtime.fake_world``)."""
    if tensor_parallel > 1:
        return init_device_mesh(device, (world_size // tensor_parallel, tensor_parallel), mesh_dim_names=("dp", "tp"))
    if mesh is None:
        return init_device_mesh(device, (world_size,))
    return init_device_mesh(device, tuple(mesh), mesh_dim_names=("replicate", "shard"))


def shutdown_rank(together: bool = True) -> None:
    """Collect garbage, wait for the other ranks, then destroy the process group.

    FSDP2's states hold reference cycles (``FSDPCommContext.post_forward_order``),
    so a dropped model is freed only by the cycle collector, at worst at
    interpreter exit, after the process group is gone; with gloo that aborted a
    rank now and then ("terminate called without an active exception", about
    1 run in 10). Callers drop their references to the workload first. A rank
    that tears its gloo connections down while a peer is still finishing its
    last collective aborted the same way (1 CI run in ~10), so the ranks meet
    at a barrier first (at most 30 s, ``monitored_barrier`` on gloo).

    Args:
        together: the ranks ended their work together. ``False`` after an
            error: they may have issued different collectives, so no barrier.
    """
    gc.collect()
    if not dist.is_initialized():
        return
    if together:
        with contextlib.suppress(Exception):  # a peer that is gone: nothing to wait for
            device_of("cpu").monitored_barrier(30.0)  # the host waits: no device work is queued at shutdown
    dist.destroy_process_group()


@dataclasses.dataclass
class JobRank:
    """One rank of a job that :func:`job_rank` started.

    Attributes:
        mesh: the device mesh the workload shards over (1-D, HSDP's ``[replicate, shard]``, or FSDP + TP's
            ``(dp, tp)``).
        group: the gloo control group over every rank (``runtime.ranks.collectives.control_group``): the job's own
            collectives, apart from training's.
        rank0: whether this is rank 0, which speaks to the study and the user.
        ended: set by the job once every rank ended its work together; the shutdown then meets the other ranks at a
            barrier first (:func:`shutdown_rank`).
    """

    mesh: DeviceMesh
    group: Any
    rank0: bool
    ended: bool = False


@contextlib.contextmanager
def job_rank(launch: LaunchTable) -> Iterator[JobRank]:
    """A rank of a job that ``[launch]`` describes (``tune``, ``profile``, ``confirm``, ``calibrate``, ``verify``):
    the process group and mesh (:func:`init_rank` with the study's backend, timeout, allocator and mesh), the control
    group, then, on leaving, :func:`shutdown_rank` (together when the job set :attr:`JobRank.ended`). The job drops
    its references to its workloads inside the block, so that they are freed before the process group goes.

    Raises:
        StudyConfigError: as :func:`init_rank`.
    """
    from runtime.ranks.collectives import control_group

    mesh = init_rank(launch.backend, launch.timeout_s, launch.allocator, launch.mesh, launch.tensor_parallel)
    rank = JobRank(mesh, None, dist.get_rank() == 0)
    try:
        rank.group = control_group(launch.timeout_s)
        yield rank
    finally:
        shutdown_rank(together=rank.ended)
