"""The mesh in a model's fingerprint is FSDP2's own (``runtime.ranks.torch_private.data_parallel_mesh``): HSDP is
read as ``(replicate, shard)``, FSDP as none, and FSDP + TP, whose parameters' DTensor mesh is also 2-D, is refused
in one line naming tensor parallelism, never read as HSDP. Built in one process on a fake world of 4 ranks."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from planner.errors import TensorParallelError
from runtime.apply import model_fingerprint
from runtime.ranks.torch_private import fake_process_group


class _Block(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.fc2(self.fc1(x).relu())


def _model(dp_mesh, tp_mesh=None) -> nn.Module:
    model = nn.Sequential(_Block(), _Block())
    for block in model:
        if tp_mesh is not None:
            parallelize_module(block, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def test_fsdp_with_tensor_parallelism_is_refused_naming_it_not_read_as_hsdp():
    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = _model(mesh["dp"], mesh["tp"])
        with pytest.raises(TensorParallelError, match="tensor parallelism") as e:
            model_fingerprint(model, 4)
        assert "\n" not in str(e.value)


def test_hsdp_is_read_from_fsdp2s_mesh_and_fsdp_has_none():
    with fake_process_group(4):
        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        assert model_fingerprint(_model(hsdp), 4).mesh == (2, 2)
        assert model_fingerprint(_model(init_device_mesh("cpu", (4,))), 4).mesh is None
