"""Every private torch attribute this project touches, in one place, each with why it is needed.

FSDP2's public API (``FSDPModule``'s ``set_*`` methods, ``unshard``, ``reshard``) configures a model but cannot
read its state back, and the one knob a plan needs that has no public setter yet is ``_set_unshard_async_op``.
What the recorder, the memory tracker and the tests must read lives in ``torch.distributed.fsdp._fully_shard``
(``FSDPState``, ``FSDPParamGroup``, ``FSDPParam``). Everything else in the project uses public torch.

``tests/runtime/ranks/test_torch_private.py`` builds a real FSDP2 model and exercises every function here, so a
torch upgrade that renames or removes one fails that test by name instead of corrupting a profile.
:data:`TESTED_TORCH` are the torch release lines the suite has passed on (``pyproject.toml`` admits the same
range; CI runs the private-API test on each).
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from planner.errors import UnsupportedPlanError

TESTED_TORCH: tuple[str, ...] = ("2.13", "2.14", "2.15")
# What an error about a missing torch API advises: the tested lines, and the newest to install.
TESTED_ADVICE = f"tested with torch {', '.join(TESTED_TORCH)}; install torch=={TESTED_TORCH[-1]}.*"


def gloo_worker_threads() -> int:
    """The worker threads a gloo process group runs its collectives on, by default (``ProcessGroupGloo``'s
    ``Options::threads``).

    Why: the simulator's CPU rule that a synchronous reduce-scatter runs beside an all-gather in flight assumes two
    ([Note: Gloo's two worker threads] in ``planner/simulation/_kernel/param_group.py``); the default is read
    from ``ProcessGroupGloo._Options()._threads``, which has no public accessor.
    """
    import torch.distributed as dist

    return int(dist.ProcessGroupGloo._Options()._threads)


def param_group(module: nn.Module) -> FSDPParamGroup | None:
    """The ``FSDPParamGroup`` of an FSDP module (``None`` if it manages no parameters of its own).

    Why: the recorder reads how the module was wrapped and clears gradients accumulated with sync off; no public
    accessor exists (``FSDPModule._get_fsdp_state()._fsdp_param_group``).
    """
    return module._get_fsdp_state()._fsdp_param_group


@dataclasses.dataclass(frozen=True)
class DataParallelMesh:
    """How FSDP2 shards one module's parameters, read from its own state.

    Attributes:
        shard_size: ranks a parameter is sharded over (``FSDPMeshInfo.shard_mesh_size``).
        replicate_size: HSDP's replicas (``HSDPMeshInfo.replicate_mesh_size``); ``None`` under FSDP.
        tensor_parallel: the parameters were DTensors before ``fully_shard`` (tensor parallelism, or another SPMD
            layout on dims beyond FSDP's: ``FSDPParam.is_dtensor``).
    """

    shard_size: int
    replicate_size: int | None
    tensor_parallel: bool


def data_parallel_mesh(module: nn.Module) -> DataParallelMesh | None:
    """FSDP2's own mesh for ``module``'s parameters; ``None`` when it manages none.

    Why: a parameter's DTensor mesh is FSDP's under FSDP and HSDP but the full (dp, tp) mesh under FSDP + TP, so
    its shape cannot tell HSDP from tensor parallelism; FSDP2's ``FSDPParamGroup.mesh_info``
    (``FSDPMeshInfo`` / ``HSDPMeshInfo``) and each ``FSDPParam.is_dtensor`` can, with no public accessor.
    """
    group = param_group(module)
    if group is None:
        return None
    info = group.mesh_info
    replicate = getattr(info, "replicate_mesh_size", None) if hasattr(info, "shard_mesh_size") else None
    return DataParallelMesh(int(info.shard_mesh_size), None if replicate is None else int(replicate),
                            any(p.is_dtensor for p in group.fsdp_params))


@dataclasses.dataclass(frozen=True)
class CollectiveDtypes:
    """The dtypes FSDP2 moves an FSDP module's parameters and gradients in, after its ``MixedPrecisionPolicy``.

    Attributes:
        all_gather: the all-gather's and the unsharded parameters' dtype (``param_dtype``, else the parameter's).
        reduce_scatter: the reduce-scatter input's dtype (``reduce_dtype``, else the unsharded gradient's, which is
            the all-gather's: ``foreach_reduce``'s ``reduce_dtype or grad_dtype``).
        sharded: the sharded parameters' and gradients' dtype (the parameter's own, ``orig_dtype``).
    """

    all_gather: torch.dtype
    reduce_scatter: torch.dtype
    sharded: torch.dtype


def collective_dtypes(module: nn.Module) -> CollectiveDtypes | None:
    """The dtypes of ``module``'s collectives under its mixed-precision policy; ``None`` when it manages no
    parameter.

    Why: FSDP2 keeps the policy on each parameter group (``FSDPParamGroup.mp_policy``) and resolves it per
    parameter only at its lazy init (``FSDPParam.init_dtype_attrs``: ``param_dtype`` dropped where it equals the
    parameter's dtype or the parameter is not floating, ``reduce_dtype`` where it equals ``param_dtype``), so the
    same clamps are applied here, before any forward; a group is all-gathered in its first parameter's dtype
    (``foreach_all_gather``). No public accessor.
    """
    return group_dtypes(param_group(module))


def group_dtypes(group: FSDPParamGroup | None) -> CollectiveDtypes | None:
    """:func:`collective_dtypes` of a parameter group; ``None`` for none or an empty one."""
    if group is None or not group.fsdp_params:
        return None
    own = group.fsdp_params[0].sharded_param.dtype
    policy = group.mp_policy
    gather = policy.param_dtype if policy.param_dtype is not None and own.is_floating_point else own
    return CollectiveDtypes(gather, policy.reduce_dtype or gather, own)


def reshard_after_forward(module: nn.Module) -> bool:
    """Whether an FSDP module frees its unsharded parameters after forward, as wrapped.

    Why: the profile records each module's setting (FSDP2's default plan keeps the root's parameters:
    ``FSDPState._lazy_init`` sets its ``post_forward_mesh_info`` to ``None``); ``set_reshard_after_forward`` has no
    getter.
    """
    group = param_group(module)
    return group is not None and group.post_forward_mesh_info is not None


def clear_unsharded_grads(module: nn.Module) -> None:
    """Drop gradients accumulated on an FSDP module's unsharded parameters (sync off).

    Why: the recorder times compute with ``set_requires_gradient_sync(False)``; the gradients it leaves on the
    unsharded parameters (``FSDPParam.unsharded_accumulated_grad``, ``FSDPParam._unsharded_param.grad``) would
    otherwise be reduced by the next synced backward and change training. From torch 2.15
    ``unsharded_accumulated_grad`` is a read-only property that reads ``_unsharded_param.grad`` (the autograd leaf
    owns accumulation), so only the latter is cleared there.
    """
    group = param_group(module)
    for fsdp_param in group.fsdp_params if group is not None else ():
        if not isinstance(getattr(type(fsdp_param), "unsharded_accumulated_grad", None), property):
            fsdp_param.unsharded_accumulated_grad = None
        if hasattr(fsdp_param, "_unsharded_param"):  # absent until the first all-gather
            fsdp_param._unsharded_param.grad = None


def unshard_async_op_setter(model: nn.Module) -> Callable[[bool], None]:
    """The setter of ``async_op`` for every FSDP module's pre-forward/pre-backward all-gathers under ``model``.

    Why: a plan's ``unshard_async_op``; FSDP2 has only the private setter
    ``FSDPModule._set_unshard_async_op``. On a CPU device this is what lets a
    prefetched all-gather run beside compute. Looked up before a plan is
    applied, so a torch without it changes nothing.

    Raises:
        UnsupportedPlanError: the running torch has no such setter.
    """
    setter = getattr(model, "_set_unshard_async_op", None)
    if setter is None:
        raise UnsupportedPlanError(
            f"plans set unshard_async_op, but torch {torch.__version__} has no FSDPModule._set_unshard_async_op "
            f"({TESTED_ADVICE})"
        )
    return setter


# model -> its dedicated reduce-scatter process group, created once (separate_reduce_scatter_group_setter).
_DEDICATED_REDUCE_SCATTER: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def separate_reduce_scatter_group_setter(model: nn.Module) -> Callable[[bool], None]:
    """The setter of a plan's ``separate_reduce_scatter_group`` for every FSDP module under ``model``.

    Why: ``FSDPModule.set_separate_reduce_scatter_group(True)`` gives
    reduce-scatter its own process group, so that it need not queue behind an
    all-gather on the shared one; but enabled again after being disabled it
    creates a new process group each time
    (``FSDPParamGroup._set_separate_reduce_scatter_group``), and plans are
    switched between steps (the race). So the public setter creates the group
    once; later it is enabled by putting that group back on each parameter
    group's ``mesh_info.reduce_scatter_process_group``, and disabled by the
    public setter. Enabling is collective (all ranks apply the same plan).

    Raises:
        UnsupportedPlanError: the running torch has no ``set_separate_reduce_scatter_group``.
    """
    public = getattr(model, "set_separate_reduce_scatter_group", None)
    if public is None:
        raise UnsupportedPlanError(
            f"the plan sets separate_reduce_scatter_group, but torch {torch.__version__} has no "
            f"FSDPModule.set_separate_reduce_scatter_group ({TESTED_ADVICE} or use a plan without it)")

    def set_separate(enable: bool) -> None:
        groups = [g for m in model.modules() if hasattr(m, "_get_fsdp_state")
                  for g in m._get_fsdp_state()._fsdp_param_groups]
        dedicated = _DEDICATED_REDUCE_SCATTER.get(model)
        if dedicated is None:  # one the model's own code set up before any plan: kept, and switched like ours
            dedicated = next((g.mesh_info.reduce_scatter_process_group for g in groups
                              if g.mesh_info.reduce_scatter_process_group is not None), None)
            if dedicated is not None:
                _DEDICATED_REDUCE_SCATTER[model] = dedicated
        if not enable:
            if dedicated is not None:
                public(False)
        elif dedicated is None:
            public(True)
            if groups:
                _DEDICATED_REDUCE_SCATTER[model] = groups[0].mesh_info.reduce_scatter_process_group
        else:
            for g in groups:
                g.mesh_info.reduce_scatter_process_group = dedicated

    return set_separate


def reduce_scatter_group(module: nn.Module) -> Any:
    """The process group an FSDP module's reduce-scatter runs on, for tests.

    ``FSDPParamGroup._reduce_scatter_process_group``.
    """
    return param_group(module)._reduce_scatter_process_group


def fsdp_state(module: nn.Module) -> Any:
    """An FSDP module's ``FSDPState`` (``FSDPModule._get_fsdp_state()``): what a prefetch list holds.

    Why: ``runtime.current_plan`` maps the states of a prefetch list back to their modules.
    """
    return module._get_fsdp_state()


def prefetch_states(module: nn.Module) -> tuple[list[Any], list[Any]]:
    """``(forward, backward)``: the ``FSDPState`` s an FSDP module explicitly prefetches, in the order it issues them.

    Why: ``set_modules_to_forward_prefetch`` and ``set_modules_to_backward_prefetch`` have no getter; they write
    ``FSDPState._states_to_forward_prefetch`` and ``_states_to_backward_prefetch`` (``runtime.current_plan``).
    """
    state = module._get_fsdp_state()
    return list(state._states_to_forward_prefetch), list(state._states_to_backward_prefetch)


# module -> {ranks: the post-forward mesh info FSDP2 built for an integer reshard_after_forward}: a model's own is
# kept when it is read, so applying the same plan again restores it without building a new mesh.
_POST_FORWARD_MESHES: weakref.WeakKeyDictionary[nn.Module, dict[int, Any]] = weakref.WeakKeyDictionary()


def reshard_after_forward_setting(module: nn.Module, root: bool = False) -> bool | int:
    """An FSDP module's ``reshard_after_forward`` as it runs: ``True`` (reshard to the shard group), ``False`` (keep
    unsharded), an ``int`` (reshard to that many ranks); ``False`` without parameters of its own (as
    :func:`reshard_after_forward`).

    Why: ``set_reshard_after_forward`` has no getter; FSDP2 holds it as ``FSDPParamGroup.post_forward_mesh_info``
    (``None``: kept; the group's ``mesh_info``: resharded; a smaller mesh: an integer, its ``shard_mesh_size``:
    ``_get_post_forward_mesh_info``). A root wrapped without a value (``FSDPState._auto_reshard_after_forward``)
    keeps its parameters from its first forward (``FSDPState._lazy_init``), so it reads ``False`` before it too:
    ``root`` says whether ``module`` is the root (FSDP2 knows only after that forward).
    """
    group = param_group(module)
    if group is None:
        return False
    state = module._get_fsdp_state()
    if getattr(state, "_auto_reshard_after_forward", False) and (state._is_root or state._is_root is None and root):
        return False  # the root under FSDP2's automatic choice: kept, from its first forward
    info = group.post_forward_mesh_info
    if info is None:
        return False
    if info is group.mesh_info or info.shard_mesh_size == group.mesh_info.shard_mesh_size:
        return True
    ranks = int(info.shard_mesh_size)
    _POST_FORWARD_MESHES.setdefault(module, {})[ranks] = info
    return ranks


def set_reshard_after_forward_ranks(module: nn.Module, ranks: int) -> None:
    """Reshard an FSDP module's parameters to ``ranks`` ranks after forward (not recursive).

    Why: ``set_reshard_after_forward`` takes a bool only; ``fully_shard(reshard_after_forward=int)`` builds the
    smaller mesh with ``_get_post_forward_mesh_info``, which this calls (a new mesh is collective: every rank
    applies the same plan). The mesh the model was wrapped with is reused once read
    (:func:`reshard_after_forward_setting`).

    Raises:
        UnsupportedPlanError: ``ranks`` does not divide the shard group's size (FSDP2's ``ValueError``).
    """
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_post_forward_mesh_info

    state = module._get_fsdp_state()
    state._auto_reshard_after_forward = False
    for group in state._fsdp_param_groups:
        known = _POST_FORWARD_MESHES.get(module, {}).get(ranks)
        if known is None:
            try:
                known = _get_post_forward_mesh_info(ranks, group.mesh_info)
            except ValueError as e:
                raise UnsupportedPlanError(f"reshard_after_forward={ranks}: {e}") from None
            _POST_FORWARD_MESHES.setdefault(module, {})[ranks] = known
        group.post_forward_mesh_info = known


# The knobs' readers (``Knob.getter`` in ``planner.artifacts.knobs``): one FSDP module's value, ``None`` where it
# manages no parameters of its own. FSDP2's setters write each parameter group's state; none has a getter.

def unshard_async_op(module: nn.Module) -> bool | None:
    """The ``async_op`` of an FSDP module's unshard (``FSDPParamGroup.unshard_async_op``: ``_set_unshard_async_op``)."""
    group = param_group(module)
    return None if group is None else bool(group.unshard_async_op)


def reduce_scatter_max_input_buffers(module: nn.Module) -> int | None:
    """``FSDPParamGroup.reduce_scatter_max_input_buffers`` (``set_reduce_scatter_max_input_buffers``)."""
    group = param_group(module)
    return None if group is None else int(group.reduce_scatter_max_input_buffers)


def unshard_in_backward(module: nn.Module) -> bool | None:
    """``FSDPParamGroup.unshard_in_backward`` (``set_unshard_in_backward``)."""
    group = param_group(module)
    return None if group is None else bool(group.unshard_in_backward)


def separate_reduce_scatter_group(module: nn.Module) -> bool | None:
    """Whether an FSDP module's reduce-scatter runs on a process group of its own: ``FSDPMeshInfo
    .reduce_scatter_process_group`` set (``set_separate_reduce_scatter_group``,
    ``FSDPParamGroup._set_separate_reduce_scatter_group``)."""
    group = param_group(module)
    if group is None:
        return None
    if not hasattr(group.mesh_info, "reduce_scatter_process_group"):
        raise AttributeError("FSDPMeshInfo.reduce_scatter_process_group")  # a torch without the knob: unknown
    return group.mesh_info.reduce_scatter_process_group is not None


def allocates_from_process_group(module: nn.Module) -> bool | None:
    """Whether an FSDP module's collectives take their buffers from the process group's allocator
    (``set_allocate_memory_from_process_group_for_comm``: ``FSDPParamGroup._all_gather_comm`` a
    ``ProcessGroupAllocAllGather``)."""
    group = param_group(module)
    if group is None:
        return None
    return type(group._all_gather_comm).__name__ == "ProcessGroupAllocAllGather"


def prefetch_counts(module: nn.Module) -> tuple[int, int]:
    """``(forward, backward)``: how many modules an FSDP module explicitly prefetches; for tests.

    Why: ``set_modules_to_forward_prefetch`` has no getter
    (``FSDPState._states_to_forward_prefetch``, ``_states_to_backward_prefetch``).
    """
    state = module._get_fsdp_state()
    return len(state._states_to_forward_prefetch), len(state._states_to_backward_prefetch)


def param_group_unsharded_bytes(group: FSDPParamGroup) -> int:
    """Bytes of a parameter group's unsharded parameters (all-gather output), padding excluded, at the dtype FSDP2
    all-gathers in (``param_dtype``, else the parameter's).

    Why: the memory tracker counts what each all-gather keeps alive
    (``FSDPParam._orig_size``: the unsharded shape; ``FSDPParam.param_dtype``).
    """
    dtypes = group_dtypes(group)
    return sum(fp._orig_size.numel() * dtypes.all_gather.itemsize for fp in group.fsdp_params) if dtypes else 0


def all_gather_issued(group: FSDPParamGroup) -> bool:
    """Whether a parameter group's all-gather is in flight or done (its output allocated).

    Why: ``FSDPParamGroup.unshard`` returns early for a group already
    unsharded; the tracker counts bytes only when an all-gather really ran
    (``FSDPParamGroup._all_gather_result``).
    """
    return group._all_gather_result is not None or group.is_unsharded


def is_sharded(group: FSDPParamGroup) -> bool:
    """Whether a parameter group holds only its shards (``FSDPParamGroup.is_sharded``)."""
    return group.is_sharded


@contextlib.contextmanager
def watching_unshard_and_reshard(
    on_unshard: Callable[[FSDPParamGroup], None], on_reshard: Callable[[FSDPParamGroup], None]
) -> Iterator[None]:
    """Call ``on_unshard(group)`` after every ``FSDPParamGroup.unshard`` and ``on_reshard(group)`` after every reshard.

    Why: on a CPU device there is no allocator peak to read; the unsharded
    parameter bytes alive are followed through FSDP2's own unshard/reshard,
    which the public API does not report. Patches the class methods inside
    the block (every FSDP module of the process) and restores them on leaving.
    """
    unshard, reshard = FSDPParamGroup.unshard, FSDPParamGroup.reshard

    def watched_unshard(group: FSDPParamGroup, *args: Any, **kwargs: Any) -> Any:
        out = unshard(group, *args, **kwargs)
        on_unshard(group)
        return out

    def watched_reshard(group: FSDPParamGroup, *args: Any, **kwargs: Any) -> Any:
        out = reshard(group, *args, **kwargs)
        on_reshard(group)
        return out

    FSDPParamGroup.unshard, FSDPParamGroup.reshard = watched_unshard, watched_reshard
    try:
        yield
    finally:
        FSDPParamGroup.unshard, FSDPParamGroup.reshard = unshard, reshard


def profiler_allocations(prof: Any, within: str | None = None) -> list[tuple[int, int, int]]:
    """``(time ns, bytes allocated (+) or freed (-), total allocated after it)`` of a memory profile, in time order.

    ``within``: only the allocations inside a ``torch.profiler.record_function(within)`` block.

    Why: the measured peak on a CPU device. ``torch.profiler.profile(profile_memory=True)``
    records every allocation with the allocator's running total
    (``c10::ProfiledCPUMemoryReporter``: "Total Allocated", bytes allocated
    while profiling and still alive, from every thread); the public
    ``prof.events()`` folds allocations into their ops and keeps no running
    total. Read from ``prof.profiler.kineto_results.experimental_event_tree()``,
    events tagged ``torch._C._profiler._EventType.Allocation``
    (``extra_fields.alloc_size``, ``total_allocated``).
    """
    from torch._C._profiler import _EventType

    out: list[tuple[int, int, int]] = []
    stack = [(e, within is None) for e in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        event, inside = stack.pop()
        if event.tag == _EventType.Allocation and inside:
            fields = event.extra_fields
            out.append((event.start_time_ns, int(fields.alloc_size), int(fields.total_allocated)))
        inside = inside or event.name == within
        stack.extend((child, inside) for child in event.children)
    out.sort()
    return out


def profiler_running() -> bool:
    """Whether a ``torch.profiler`` (or ``torch.autograd.profiler``) profile is active in this process
    (``torch.autograd._profiler_enabled``).

    Why: a profiler cannot start inside another; the compute timer's memory run on CPU profiles, so under a
    user's profiler it reads no memory instead of failing the user's job.
    """
    return bool(torch.autograd._profiler_enabled())


def profiler_marks(prof: Any, prefix: str) -> list[tuple[int, str]]:
    """``(time ns, name)`` of the ``record_function`` blocks whose name starts with ``prefix``, in time order, on
    the clock of :func:`profiler_allocations`.

    Why: the bytes alive at chosen points of a profiled run on a CPU device (:mod:`runtime.recording.compute_timer`
    marks
    each module's window with an empty block). Read from the same event tree as :func:`profiler_allocations`
    (``experimental_event_tree()``, ``name``, ``start_time_ns``).
    """
    out: list[tuple[int, str]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.name.startswith(prefix):
            out.append((event.start_time_ns, event.name))
        stack.extend(event.children)
    out.sort()
    return out


def profiler_mark(name: str) -> Any:
    """An empty block named ``name`` in the running profiler's trace (:func:`profiler_marks` finds it), entered
    outside the dispatcher (``torch._C._profiler._RecordFunctionFast``). Why: ``record_function`` is a dispatcher
    op, which selective activation checkpointing's recomputation raises on when its forward did not run it."""
    return torch._C._profiler._RecordFunctionFast(name)


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A default process group of ``world_size`` ranks in this one process, whose collectives do nothing.

    Why: ``prefetch-planner profile --from-trace --model FACTORY`` builds the traced job's model to read its
    parameter counts (:func:`runtime.apply.model_fingerprint`), sharded over the traces' world size, without
    launching ranks. ``fully_shard`` needs a mesh of that size; torch's testing ``FakeStore`` and its ``"fake"``
    backend (``torch.testing._internal.distributed.fake_pg``) give one.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
