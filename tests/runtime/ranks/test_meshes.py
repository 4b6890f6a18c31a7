"""The mesh in a model's fingerprint is FSDP2's own (``runtime.ranks.torch_private.data_parallel_mesh``): HSDP is
read as ``(replicate, shard)``, FSDP as none, and FSDP + TP, whose parameters' DTensor mesh is also 2-D, as its TP
degree with the TP-local sizes FSDP2 all-gathers, never as HSDP; HSDP + TP and a model that is one part of several
are refused in one line. So are the dtypes FSDP2 moves the parameters in under a
mixed-precision policy (``torch_private.collective_dtypes``). Built in one process on a fake world of 4 ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from planner.errors import TensorParallelError, UnsupportedPlanError
from runtime.apply import model_fingerprint
from runtime.ranks.torch_private import (
    DataParallelMesh,
    data_parallel_groups,
    data_parallel_mesh,
    fake_process_group,
    unsharded_shapes,
)


class _Block(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.fc2(self.fc1(x).relu())


def _model(dp_mesh, tp_mesh=None, policies=None) -> nn.Module:
    model = nn.Sequential(_Block(), _Block())
    policies = policies or [MixedPrecisionPolicy()] * 3
    for block, policy in zip(model, policies, strict=False):
        if tp_mesh is not None:
            parallelize_module(block, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policies[-1])
    return model


def test_fsdp_with_tensor_parallelism_is_read_as_its_tp_degree_with_tp_local_sizes_not_as_hsdp():
    """dp 2 x tp 2: fc1 column-wise and fc2 row-wise split their weights over the TP ranks (fc2's bias stays whole),
    so FSDP2 all-gathers over the dp ranks the TP-local tensors, not the global ones."""
    whole = 16 * 64 + 64 + 64 * 16 + 16
    local = 32 * 16 + 32 + 16 * 32 + 16
    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        fp = model_fingerprint(_model(mesh["dp"], mesh["tp"]), 4)
        assert (fp.tensor_parallel, fp.mesh, fp.shard_size) == (2, None, 2)
        assert fp.param_numels == (0, local, local) and fp.param_bytes == (0, 4 * local, 4 * local)
        assert fp.mesh_text == "FSDP 2 x TP 2"
        plain = model_fingerprint(_model(init_device_mesh("cpu", (4,))), 4)
        assert plain.param_numels == (0, whole, whole) and plain.tensor_parallel is None
        assert fp.first_difference(dataclasses.replace(plain, param_numels=fp.param_numels)) == (
            "mesh: plan was made for FSDP 2 x TP 2, this run has FSDP")
        assert "tensor_parallel" not in plain.to_dict() and fp.to_dict()["tensor_parallel"] == 2


def test_hsdp_with_tensor_parallelism_is_refused_in_one_line():
    with fake_process_group(8):
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
        with pytest.raises(TensorParallelError, match="HSDP with tensor parallelism") as e:
            model_fingerprint(_model(mesh["replicate", "shard"], mesh["tp"]), 8)
        assert "\n" not in str(e.value)


def test_a_model_fsdp_shards_over_part_of_the_job_is_refused_naming_pipeline_parallelism():
    """FSDP over 2 of 4 ranks with plain parameters: one model part of several, which a plan cannot time."""
    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        with pytest.raises(UnsupportedPlanError, match="pipeline parallelism") as e:
            model_fingerprint(_model(mesh["dp"]), 4)
        assert "\n" not in str(e.value)


def test_hsdp_is_read_from_fsdp2s_mesh_and_fsdp_has_none():
    with fake_process_group(4):
        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        assert model_fingerprint(_model(hsdp), 4).mesh == (2, 2)
        assert model_fingerprint(_model(init_device_mesh("cpu", (4,))), 4).mesh is None


def test_bf16_mixed_precision_is_read_from_fsdp2s_parameters():
    """``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``: FSDP2 all-gathers 2 bytes a parameter
    and reduce-scatters 4, the sharded parameters stay fp32; without a policy, 4 bytes and no cast."""
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    numel = 16 * 64 + 64 + 64 * 16 + 16  # one block's parameters
    with fake_process_group(4):
        fsdp = init_device_mesh("cpu", (4,))
        fp = model_fingerprint(_model(fsdp, policies=[bf16] * 3), 4)
        assert fp.param_bytes == (0, 2 * numel, 2 * numel) and fp.param_numels == (0, numel, numel)
        assert fp.mixed_precision == ("torch.bfloat16", "torch.float32") and fp.param_dtypes == ("torch.float32",)
        assert fp.reduce_scatter_scale() == 2.0 and fp.collective_scale("all_gather") == 0.5
        plain = model_fingerprint(_model(fsdp), 4)
        assert plain.param_bytes == (0, 4 * numel, 4 * numel) and plain.mixed_precision is None
        assert "mixed precision: plan was made for bf16 all-gather, fp32 reduce-scatter, this run has no mixed " \
               "precision" == fp.first_difference(plain)
        mixed = [bf16, MixedPrecisionPolicy(), bf16]
        with pytest.raises(UnsupportedPlanError, match="different mixed-precision dtypes"):
            model_fingerprint(_model(fsdp, policies=mixed), 4)


def test_the_autotuner_stops_on_hsdp_with_tensor_parallelism_in_one_line(tmp_path):
    """HSDP (1 x 2) x tp 2: the AutoTuner stops at construction, naming HSDP with tensor parallelism, before it
    opens a study or runs a step."""
    from runtime import AutoTuner

    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
        model = _model(mesh["replicate", "shard"], mesh["tp"])
        with pytest.raises(TensorParallelError, match="HSDP with tensor parallelism") as e:
            AutoTuner(model, "tp", f"sqlite:///{tmp_path}/tp.db")
        assert "\n" not in str(e.value)
    assert not (tmp_path / "tp.db").exists()


def test_fsdp_with_tensor_parallelism_reads_its_degree_groups_and_tp_local_shapes():
    """dp 2 x tp 2 on a fake world of 4: FSDP2's mesh info gives the dp group (never the parameters' (dp, tp) mesh),
    each ``FSDPParam._spmd_mesh`` the TP degree, each ``FSDPParam._orig_size`` the TP-local shape it all-gathers."""
    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        block = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
        parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
        assert data_parallel_mesh(block) == DataParallelMesh(2, None, 2)
        shard_group, replicate_group = data_parallel_groups(block)
        assert shard_group.size() == 2 and replicate_group is None
        shapes = unsharded_shapes(block)
        assert sorted(tuple(shapes[id(p)]) for p in block.parameters()) == [(16,), (16, 32), (32,), (32, 16)]
