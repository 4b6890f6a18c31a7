"""Small FSDP2 models the in-process runtime tests build on the one-rank ``mesh`` fixture."""

import torch
from torch.distributed.fsdp import fully_shard

from runtime.reference_workloads import MLPStack


def sharded_mlp(mesh, layers: int = 3, dim: int = 16) -> MLPStack:
    """``MLPStack(dim, layers)`` seeded 0, ``fully_shard`` on each block then the root."""
    torch.manual_seed(0)
    m = MLPStack(dim=dim, layers=layers)
    for block in m.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m
