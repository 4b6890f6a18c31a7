"""FSDP2's per-module state: parameter groups, meshes, dtypes, resharding, prefetch lists and unsharded bytes.

Read by the fingerprint, the recorder and the memory tracker, and by ``runtime.current_plan`` for a plan's
structure; none of it has a public accessor (``FSDPState``, ``FSDPParamGroup``, ``FSDPParam``)."""

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


def param_groups(module: nn.Module) -> list[FSDPParamGroup]:
    """Every ``FSDPParamGroup`` of an FSDP module: none when it manages no parameters of its own, one, or several
    where ``fully_shard(shard_placement_fn=...)`` puts its parameters on several meshes (per-parameter meshes:
    experts and dense weights sharded apart).

    Why: FSDP2's setters write each group's state and its runtime reads it per group
    (``FSDPState._fsdp_param_groups``); the singular ``_fsdp_param_group`` asserts on a module with several. A torch
    before per-parameter meshes (2.11) holds the singular one only.
    """
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        return [] if state._fsdp_param_group is None else [state._fsdp_param_group]
    return list(groups)


class SeveralParamGroupsError(UnsupportedPlanError):
    """An FSDP module holds its parameters in several parameter groups (per-parameter meshes), where the recorder
    and the fingerprint need one."""


def param_group(module: nn.Module) -> FSDPParamGroup | None:
    """The one ``FSDPParamGroup`` of an FSDP module (``None`` if it manages no parameters of its own).

    Why: the recorder reads how the module was wrapped and clears gradients accumulated with sync off; no public
    accessor exists (``FSDPModule._get_fsdp_state()._fsdp_param_group``, which asserts on several groups).

    Raises:
        SeveralParamGroupsError: the module's parameters live on several meshes (:func:`param_groups`).
    """
    groups = param_groups(module)
    if len(groups) > 1:
        raise SeveralParamGroupsError(
            f"an FSDP module holds its parameters in {len(groups)} parameter groups (per-parameter meshes from "
            f"shard_placement_fn: {', '.join(repr(g._module_fqn) for g in groups)}): recording and tuning such a "
            "module is not supported yet; plans still apply to it (apply_plan), or wrap its parameters on one mesh")
    return groups[0] if groups else None




@dataclasses.dataclass(frozen=True)
class DataParallelMesh:
    """How FSDP2 shards one module's parameters, read from its own state.

    Attributes:
        shard_size: ranks a parameter is sharded over (``FSDPMeshInfo.shard_mesh_size``).
        replicate_size: HSDP's replicas (``HSDPMeshInfo.replicate_mesh_size``); ``None`` under FSDP.
        tensor_parallel: the ranks of the parameters' own layout beyond FSDP's: 1 for plain parameters; for
            parameters that were DTensors before ``fully_shard`` (tensor parallelism), their SPMD mesh's ranks over
            FSDP's (``FSDPParam._spmd_mesh``, the dp mesh concatenated with the parameter's TP mesh,
            ``FSDPParam._init_sharding_spec_tp``).
    """

    shard_size: int
    replicate_size: int | None
    tensor_parallel: int


def data_parallel_mesh(module: nn.Module) -> DataParallelMesh | None:
    """FSDP2's own mesh for ``module``'s parameters; ``None`` when it manages none.

    Why: a parameter's DTensor mesh is FSDP's under FSDP and HSDP but the full (dp, tp) mesh under FSDP + TP, so
    its shape cannot tell HSDP from tensor parallelism; FSDP2's ``FSDPParamGroup.mesh_info``
    (``FSDPMeshInfo`` / ``HSDPMeshInfo``) and each ``FSDPParam.is_dtensor`` can, with no public accessor.

    Raises:
        SeveralParamGroupsError: its parameter groups are sharded on meshes of different sizes.
    """
    meshes = set()
    for group in param_groups(module):
        info = group.mesh_info
        replicate = getattr(info, "replicate_mesh_size", None) if hasattr(info, "shard_mesh_size") else None
        data_parallel = int(info.shard_mesh_size) * int(replicate or 1)
        spmd = {int(p._spmd_mesh.size()) for p in group.fsdp_params if p.is_dtensor}
        meshes.add(DataParallelMesh(int(info.shard_mesh_size), None if replicate is None else int(replicate),
                                    max(spmd, default=data_parallel) // data_parallel))
    if len(meshes) > 1:
        raise SeveralParamGroupsError(f"an FSDP module's parameters are sharded on {len(meshes)} meshes "
                                      f"(per-parameter meshes: {sorted(meshes, key=repr)}): not tuned yet")
    return meshes.pop() if meshes else None


def data_parallel_groups(module: nn.Module) -> tuple[Any, Any] | None:
    """The process groups FSDP2 runs ``module``'s collectives on: the shard group (all-gather, reduce-scatter) and
    HSDP's replicate group (all-reduce; ``None`` under FSDP). ``None`` when it manages no parameters.

    Why: under FSDP + TP a parameter's DTensor mesh is the whole (dp, tp) mesh, so its groups are not FSDP's;
    ``FSDPMeshInfo.shard_process_group`` and ``HSDPMeshInfo.replicate_process_group`` are, with no public
    accessor.
    """
    for group in param_groups(module):
        info = group.mesh_info
        return info.shard_process_group, getattr(info, "replicate_process_group", None)
    return None


def unsharded_shapes(module: nn.Module) -> dict[int, torch.Size]:
    """Per parameter ``module`` manages (keyed by ``id`` of the sharded parameter), the shape FSDP2 all-gathers it
    to: the whole tensor for a plain parameter, the tensor-parallel local tensor for a DTensor one.

    Why: under FSDP + TP a parameter's shape is the global one across the TP ranks, while FSDP2 shards and
    all-gathers the TP-local tensor (``FSDPParam._orig_size``, set from ``param._local_tensor`` in
    ``FSDPParam._init_sharding_spec_tp``); no public accessor.
    """
    return {id(p.sharded_param): p._orig_size for group in param_groups(module) for p in group.fsdp_params}


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

    Raises:
        SeveralParamGroupsError: its parameter groups move in different dtypes.
    """
    moved = {group_dtypes(g) for g in param_groups(module)} - {None}
    if len(moved) > 1:
        raise SeveralParamGroupsError(f"an FSDP module's parameter groups move in different dtypes: "
                                      f"{sorted(moved, key=repr)}")
    return moved.pop() if moved else None


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
    ``root`` says whether ``module`` is the root (FSDP2 knows only after that forward). A module with several
    parameter groups (:func:`param_groups`) reads the setting they share.

    Raises:
        SeveralParamGroupsError: its parameter groups reshard differently (no plan can hold that).
    """
    groups = param_groups(module)
    if not groups:
        return False
    state = module._get_fsdp_state()
    if getattr(state, "_auto_reshard_after_forward", False) and (state._is_root or state._is_root is None and root):
        return False  # the root under FSDP2's automatic choice: kept, from its first forward
    settings: list[bool | int] = []
    for group in groups:
        info = group.post_forward_mesh_info
        if info is None:
            settings.append(False)
        elif info is group.mesh_info or info.shard_mesh_size == group.mesh_info.shard_mesh_size:
            settings.append(True)
        else:
            settings.append(int(info.shard_mesh_size))
            if len(groups) == 1:
                _POST_FORWARD_MESHES.setdefault(module, {})[int(info.shard_mesh_size)] = info
    if len({(type(x), x) for x in settings}) > 1:  # typed: True is not a reshard to 1 rank
        raise SeveralParamGroupsError(f"an FSDP module's {len(groups)} parameter groups reshard after forward "
                                      f"differently ({settings}): no plan holds that")
    return settings[0]


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
    for group in param_groups(module):
        known = _POST_FORWARD_MESHES.get(module, {}).get(ranks)
        if known is None:
            try:
                known = _get_post_forward_mesh_info(ranks, group.mesh_info)
            except ValueError as e:
                raise UnsupportedPlanError(f"reshard_after_forward={ranks}: {e}") from None
            _POST_FORWARD_MESHES.setdefault(module, {})[ranks] = known
        group.post_forward_mesh_info = known



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


