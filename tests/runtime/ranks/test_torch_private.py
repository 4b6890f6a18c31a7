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
from tests.runtime.models import sharded_mlp


@pytest.fixture
def model(mesh):
    return sharded_mlp(mesh)


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


def test_the_default_store_the_live_groups_their_counters_and_nccls_abort(model):
    """The failure board's private reads: the default store takes keys any rank reads, and clones into a second
    client; every live group is listed, the default one among them; a collective moves the group's counter by one;
    gloo has no NCCL communicator to abort."""
    import torch.distributed as dist

    store = torch_private.default_store()
    store.set("torch-private-test", "1")
    assert store.clone().check(["torch-private-test"])
    groups = torch_private.live_groups()
    assert dist.group.WORLD in groups
    before = torch_private.collective_sequence(dist.group.WORLD)
    dist.all_reduce(torch.ones(1))
    assert torch_private.collective_sequence(dist.group.WORLD) == before + 1
    assert torch_private.abort_nccl(groups) == 0


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


# What FSDP2 itself acts on for each knob, read from its own state (not through torch_private's readers): the
# value the next step uses. ``apply_plan`` must make it the plan's, before the first forward and after it.
def _groups(model):
    return [g for m in model.modules() if hasattr(m, "_get_fsdp_state") for g in m._get_fsdp_state()._fsdp_param_groups]


def _one(values):
    assert len(set(values)) == 1, values
    return values[0]


FSDP2_STATE = {
    "unshard_async_op": lambda model: _one([g.unshard_async_op for g in _groups(model)]),
    # post_backward reads the comm context's cap, set once at the root's lazy init (_init_shared_state)
    "reduce_scatter_max_input_buffers": lambda model: (
        model._get_fsdp_state()._comm_ctx.reduce_scatter_max_input_buffers),
    # prepare_microbatch sets it on every group before a microbatch that is not the step's last
    "reshard_after_backward": lambda model: _one([g.reshard_after_backward for g in _groups(model)]),
    "separate_reduce_scatter_group": lambda model: _one(
        [g._reduce_scatter_process_group is not g.mesh_info.shard_process_group for g in _groups(model)]),
    "unshard_in_backward": lambda model: model.blocks[0]._get_fsdp_state()._fsdp_param_groups[0].unshard_in_backward,
    "allocate_memory_from_process_group_for_comm": lambda model: _one(
        [type(g._all_gather_comm).__name__ == "ProcessGroupAllocAllGather" for g in _groups(model)]),
    # the root hands the event to its all-gather streams at the next forward (FSDPState._root_pre_forward)
    "post_optim_event": lambda model: model._get_fsdp_state()._state_ctx.post_optim_event is not None,
}


@pytest.mark.parametrize("first_forward", ["before", "after"])
@pytest.mark.parametrize("name", list(FSDP2_STATE))
def test_every_knob_applied_is_what_fsdp2_acts_on(mesh, monkeypatch, name, first_forward):
    """A plan setting one knob away from FSDP2's default, applied before the model's first forward or after a step,
    then a step: FSDP2's own state holds the plan's value, ``current_plan`` reads that value, and FSDP2's default
    applied after puts FSDP2's back. (A module knob's state is read at each pre-backward, so the step after it is
    a forward: ``unshard_in_backward = False`` on a block whose backward needs its parameters cannot run one.)"""
    import dataclasses

    import runtime.post_optim as post_optim
    from planner.artifacts.knobs import KNOBS, Scope, knob
    from runtime.accumulation import prepare_microbatch
    from runtime.apply import apply_plan
    from runtime.current import current_plan, fsdp2_default
    from runtime.reference_workloads import mlp

    assert set(FSDP2_STATE) == {k.name for k in KNOBS}  # a knob added to the registry is added here
    k = knob(name)
    other = next(v for v in k.choices if v != k.default)
    monkeypatch.setattr(post_optim, "event_after_step", lambda m: object())  # a CPU device records no event
    workload = mlp(mesh, dim=16, layers=3)
    model, optimizer = workload.model, workload.optimizer
    backward = k.scope is not Scope.MODULE

    def step():
        loss = workload.loss_fn(model, workload.make_batch(0))
        if backward:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        prepare_microbatch(model, 0, 2)  # what the next microbatch of an accumulating step would run with

    if first_forward == "after":
        step()
    default = fsdp2_default(model)
    if k.scope is Scope.MODULE:
        block = default.modules["blocks.0"].with_knobs(**{name: other})
        plan = dataclasses.replace(default, modules={**default.modules, "blocks.0": block})
    else:
        plan = default.with_knobs(**{name: other})
    apply_plan(model, plan)
    step()
    assert FSDP2_STATE[name](model) == other
    read = current_plan(model)
    assert (read.modules["blocks.0"].knobs if k.scope is Scope.MODULE else read.knobs)[name] == other
    apply_plan(model, default)
    step()
    assert FSDP2_STATE[name](model) == (k.default if name != "reshard_after_backward" else True)
    model.set_requires_gradient_sync(True)


def test_the_public_setter_alone_changes_nothing_fsdp2_acts_on_after_its_lazy_init(model):
    """[torch 2.13, 2.14] ``set_reduce_scatter_max_input_buffers`` after the first forward writes the parameter
    groups, which FSDP2 no longer reads: the reader reads what FSDP2 acts on (1), and the project's setter sets it."""
    _step(model)
    model.set_reduce_scatter_max_input_buffers(2)
    assert _one([g.reduce_scatter_max_input_buffers for g in _groups(model)]) == 2
    assert model._get_fsdp_state()._comm_ctx.reduce_scatter_max_input_buffers == 1
    assert torch_private.reduce_scatter_max_input_buffers(model.blocks[1]) == 1
    torch_private.reduce_scatter_max_input_buffers_setter(model)(2)
    assert torch_private.reduce_scatter_max_input_buffers(model.blocks[1]) == 2
    _step(model)
    assert model._get_fsdp_state()._comm_ctx.reduce_scatter_max_input_buffers == 2


def test_a_module_with_several_parameter_groups_is_read_and_planned(mesh):
    """Per-parameter meshes (``shard_placement_fn`` putting the blocks' 64-row weights on a mesh of their own
    process group): each block holds 2 parameter groups. ``current_plan`` reads FSDP2's default, a plan with every
    plan knob changed applies to both groups and reads back, and the recorder's one-group accessor refuses the
    module in one line instead of FSDP2's assertion."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    from planner.artifacts.knobs import PLAN_KNOBS
    from runtime.apply import apply_plan
    from runtime.current import current_plan, fsdp2_default

    experts = FSDPMeshInfo(DeviceMesh.from_group(dist.new_group([0]), "cpu"), shard_mesh_dim=0)
    torch.manual_seed(0)
    m = MLPStack(dim=16, layers=2)
    for block in m.blocks:
        fully_shard(block, mesh=mesh, shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), experts)
                    if p.dim() == 2 and p.shape[0] == 64 else None)
    fully_shard(m, mesh=mesh)
    assert [len(torch_private.param_groups(b)) for b in m.blocks] == [2, 2]
    default = fsdp2_default(m)
    assert current_plan(m).behaviour_key() == default.behaviour_key()
    changed = default.with_knobs(**{k.name: next(v for v in k.choices if v != k.default) for k in PLAN_KNOBS
                                    if k.name != "reshard_after_backward"})  # only with microbatches
    apply_plan(m, changed)
    _step(m)
    assert current_plan(m).knobs == changed.knobs
    assert [g.unshard_async_op for g in _groups(m)] == [True] * 5
    apply_plan(m, default)
    with pytest.raises(torch_private.SeveralParamGroupsError, match="2 parameter groups"):
        torch_private.param_group(m.blocks[0])
