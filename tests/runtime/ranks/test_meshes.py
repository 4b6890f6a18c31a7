"""The mesh in a model's fingerprint is FSDP2's own (``runtime.ranks.torch_private.data_parallel_mesh``): HSDP is
read as ``(replicate, shard)``, FSDP as none, and FSDP + TP, whose parameters' DTensor mesh is also 2-D, is refused
in one line naming tensor parallelism, never read as HSDP. So are the dtypes FSDP2 moves the parameters in under a
mixed-precision policy (``torch_private.collective_dtypes``). Built in one process on a fake world of 4 ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from planner.errors import TensorParallelError, UnsupportedPlanError
from runtime.apply import model_fingerprint
from runtime.ranks.torch_private import fake_process_group


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


def test_the_autotuner_stops_on_fsdp_and_hsdp_with_tensor_parallelism_in_one_line(tmp_path):
    """dp 2 x tp 2, and HSDP (1 x 2) x tp 2: the AutoTuner stops at construction, naming tensor parallelism, before
    it opens a study or runs a step."""
    from runtime import AutoTuner

    with fake_process_group(4):
        for shape, names in (((2, 2), ("dp", "tp")), ((1, 2, 2), ("replicate", "shard", "tp"))):
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            model = _model(mesh[names[:-1]] if len(names) == 3 else mesh["dp"], mesh["tp"])
            with pytest.raises(TensorParallelError, match="tensor parallelism") as e:
                AutoTuner(model, "tp", f"sqlite:///{tmp_path}/tp.db")
            assert "\n" not in str(e.value)
    assert not (tmp_path / "tp.db").exists()
