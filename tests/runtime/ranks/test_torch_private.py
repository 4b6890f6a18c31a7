"""Every private torch attribute the project uses still exists and means what runtime/ranks/torch_private.py says.

A one-rank gloo process group in this process and a real FSDP2 model: if a
torch upgrade renames or changes one of them, the test of that function
fails, by name.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import fully_shard

from runtime.ranks import torch_private
from runtime.recording.memory import UnshardedBytesTracker
from runtime.reference_workloads import MLPStack


@pytest.fixture
def model(mesh):
    torch.manual_seed(0)
    m = MLPStack(dim=16, layers=3)
    for block in m.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _step(model):
    model(torch.randn(4, 16)).pow(2).mean().backward()


def test_tested_torch_is_the_running_torch():
    line = ".".join(torch.__version__.split(".")[:2])
    assert line in torch_private.TESTED_TORCH, (
        f"torch {torch.__version__} is not a tested line {torch_private.TESTED_TORCH}: check "
        "runtime/ranks/torch_private.py against it, then add it to TESTED_TORCH and pyproject.toml's range"
    )


def test_pyproject_admits_exactly_the_tested_lines():
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())["project"]
    (torch_req,) = [Requirement(d) for d in project["dependencies"] if Requirement(d).name == "torch"]
    lines = [f"2.{minor}" for minor in range(5, 30)]
    admitted = [line for line in lines if torch_req.specifier.contains(f"{line}.0")]
    assert admitted == list(torch_private.TESTED_TORCH), (torch_req, admitted)


def test_gloo_runs_two_collectives_at_once_as_the_simulator_assumes():
    assert torch_private.gloo_worker_threads() == 2  # [Note: Gloo's two worker threads]


def test_param_group_and_reshard_after_forward(model):
    _step(model)  # lazy init: the root's setting is decided there (FSDPState._lazy_init)
    block = model.blocks[0]
    group = torch_private.param_group(block)
    assert group is not None and len(group.fsdp_params) == 6  # norm, fc1, fc2: weight and bias each
    assert torch_private.reshard_after_forward(block) is True
    assert torch_private.reshard_after_forward(model) is False
    block.set_reshard_after_forward(False, recurse=False)
    assert torch_private.reshard_after_forward(block) is False


def test_unshard_async_op_setter_reaches_every_module(model):
    torch_private.unshard_async_op_setter(model)(True)
    assert [torch_private.unshard_async_op(m) for m in (model, *model.blocks)] == [True] * 4
    torch_private.unshard_async_op_setter(model)(False)
    assert torch_private.unshard_async_op(model.blocks[2]) is False


def test_separate_reduce_scatter_group_is_created_once_and_switched(model):
    shared = torch_private.reduce_scatter_group(model.blocks[0])
    setter = torch_private.separate_reduce_scatter_group_setter(model)
    setter(False)  # never enabled: nothing to undo, no group created
    assert torch_private.reduce_scatter_group(model.blocks[0]) is shared
    setter(True)
    dedicated = torch_private.reduce_scatter_group(model.blocks[0])
    assert dedicated is not shared
    assert [torch_private.reduce_scatter_group(m) for m in (model, *model.blocks)] == [dedicated] * 4
    setter(False)
    assert torch_private.reduce_scatter_group(model.blocks[2]) is shared
    setter(True)  # the same group again, not a new one
    assert torch_private.reduce_scatter_group(model.blocks[1]) is dedicated
    _step(model)  # FSDP2 runs its reduce-scatters on it


def test_prefetch_counts_read_back_the_public_setters(model):
    model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1], model.blocks[2]])
    model.blocks[2].set_modules_to_backward_prefetch([model.blocks[1]])
    assert torch_private.prefetch_counts(model.blocks[0]) == (2, 0)
    assert torch_private.prefetch_counts(model.blocks[2]) == (0, 1)


def test_clear_unsharded_grads_drops_accumulated_gradients(model):
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    _step(model)
    group = torch_private.param_group(model.blocks[0])
    assert any(fp._unsharded_param.grad is not None or fp.unsharded_accumulated_grad is not None
               for fp in group.fsdp_params)
    torch_private.clear_unsharded_grads(model.blocks[0])
    assert all(fp._unsharded_param.grad is None and fp.unsharded_accumulated_grad is None
               for fp in group.fsdp_params)
    model.set_requires_gradient_sync(True)
    model.set_reshard_after_backward(True)


def test_unsharded_bytes_and_the_unshard_reshard_watch(model):
    block = model.blocks[1]
    group = torch_private.param_group(block)
    dim = 16
    expected = 4 * (dim * 4 * dim * 2 + 4 * dim + dim + 2 * dim)  # fc1, fc2, biases, layer norm; float32
    assert torch_private.param_group_unsharded_bytes(group) == expected
    assert torch_private.is_sharded(group) and not torch_private.all_gather_issued(group)
    seen = []
    with torch_private.watching_unshard_and_reshard(lambda g: seen.append(("unshard", g)),
                                                    lambda g: seen.append(("reshard", g))):
        block.unshard()
        assert torch_private.all_gather_issued(group)
        block.reshard()
    assert seen == [("unshard", group), ("reshard", group)]
    assert torch_private.is_sharded(group)
    block.unshard()  # the patch is gone: nothing recorded outside the block
    block.reshard()
    assert len(seen) == 2


def test_tracker_counts_the_blocks_alive(model):
    torch_private.unshard_async_op_setter(model)(True)
    model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1]])
    with UnshardedBytesTracker() as tracker:
        _step(model)
    one_block = torch_private.param_group_unsharded_bytes(torch_private.param_group(model.blocks[0]))
    root = torch_private.param_group_unsharded_bytes(torch_private.param_group(model))
    assert tracker.peak_bytes >= root + 2 * one_block  # the root stays unsharded; a block computing, one prefetched


def test_profiler_allocations_and_marks_share_one_clock():
    """The recorder's marks (``profiler_mark``, outside the dispatcher) and ``record_function`` blocks alike."""
    from torch.profiler import ProfilerActivity, profile, record_function

    assert not torch_private.profiler_running()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        assert torch_private.profiler_running()
        with torch_private.profiler_mark("test: mark 0"):
            pass
        kept = torch.empty(1 << 20, dtype=torch.uint8)
        with record_function("test: mark 1"):
            pass
        del kept
        with torch_private.profiler_mark("test: mark 2"):
            pass
    marks = torch_private.profiler_marks(prof, "test: mark ")
    assert [name for _, name in marks] == ["test: mark 0", "test: mark 1", "test: mark 2"]
    allocations = torch_private.profiler_allocations(prof)
    between = [size for t, size, _ in allocations if marks[0][0] <= t <= marks[1][0]]
    after = [size for t, size, _ in allocations if marks[1][0] <= t <= marks[2][0]]
    assert 1 << 20 in between and -(1 << 20) in after  # the MiB allocated between the first two, freed after
