"""The planner's re-sharded bytes against FSDP2's own shards: a model sharded on fake worlds of several sizes."""

from __future__ import annotations

import dataclasses

import pytest
from torch.distributed.device_mesh import init_device_mesh

from planner.simulation.resharding import shard_bytes
from planner.testing import synthetic_profile
from runtime.ranks.torch_private import fake_process_group
from runtime.reference_workloads import mlp
from runtime.workload import fsdp_modules, own_parameters, parameter_rows


def rows_and_rank0_shards(world_size: int, dim: int):
    with fake_process_group(world_size):  # rank 0: the largest shard, ceil(dim0 / S) rows
        workload = mlp(init_device_mesh("cpu", (world_size,)), dim=dim, layers=2)
        modules = fsdp_modules(workload.model)
        shards = {fqn: sum(p.to_local().numel() * p.element_size() for p in own_parameters(modules, fqn))
                  for fqn, _ in modules}
        return parameter_rows(modules), shards


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_shard_predicted_from_another_world_size_is_fsdp2s(world_size):
    """Rows recorded at 2 ranks predict the shard FSDP2 makes at 3 and 4 (dim 0 of 37: padded, uneven)."""
    rows, _ = rows_and_rank0_shards(2, dim=37)
    _, shards = rows_and_rank0_shards(world_size, dim=37)
    module = synthetic_profile().modules["b0"]
    for fqn, own in rows.items():
        assert shard_bytes(dataclasses.replace(module, parameter_rows=own), world_size) == shards[fqn]
