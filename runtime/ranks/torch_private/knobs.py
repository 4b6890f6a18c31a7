"""The knobs' setters that need more than FSDP2's public one, and the knobs' readers (``Knob.getter`` in
``planner.artifacts.knobs``): what FSDP2 acts on at the next step, read from its state."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from planner.errors import UnsupportedPlanError
from runtime.ranks.torch_private.state import param_group, param_groups
from runtime.ranks.torch_private.versions import TESTED_ADVICE


class UnknownState(AttributeError):
    """A knob's state that cannot be read on this module: the running torch does not hold it, the module's parameter
    groups disagree, or a custom comm replaced what the knob sets (``runtime.current_plan`` marks the knob
    unknown; an ``AttributeError``, as a missing attribute of an older torch is)."""


def _groups_agree(module: nn.Module, read: Callable[[FSDPParamGroup], Any]) -> Any:
    """``read(group)`` on every parameter group of ``module``: the one value they agree on, ``None`` for a module
    without parameters of its own.

    Raises:
        UnknownState: the groups disagree.
    """
    values = {read(g) for g in param_groups(module)}
    if len(values) > 1:
        raise UnknownState(f"the parameter groups disagree: {sorted(values, key=repr)}")
    return values.pop() if values else None




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
        groups = [g for m in model.modules() if hasattr(m, "_get_fsdp_state") for g in param_groups(m)]
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



# The knobs' readers (``Knob.getter`` in ``planner.artifacts.knobs``): one FSDP module's value, ``None`` where it
# manages no parameters of its own. FSDP2's setters write each parameter group's state; none has a getter.

# Each reads what FSDP2 acts on at the next step, over every parameter group of the module (they must agree:
# :func:`_groups_agree`), and raises an ``AttributeError`` (:class:`UnknownState`) where it cannot be read.

def unshard_async_op(module: nn.Module) -> bool | None:
    """The ``async_op`` of an FSDP module's unshard (``FSDPParamGroup.unshard_async_op``: ``_set_unshard_async_op``),
    read at each pre-forward and pre-backward unshard and each prefetch."""
    return _groups_agree(module, lambda g: bool(g.unshard_async_op))


def lazily_initialized(module: nn.Module) -> bool:
    """Whether the root of ``module`` ran its first forward (``FSDPState._lazy_init``: ``_is_root`` set on every
    state under it), after which the states share the root's comm context."""
    return module._get_fsdp_state()._is_root is not None


def reduce_scatter_max_input_buffers(module: nn.Module) -> int | None:
    """How many reduce-scatter input buffers FSDP2 keeps in flight for ``module``'s gradients.

    Why: ``set_reduce_scatter_max_input_buffers`` writes each parameter group's
    ``reduce_scatter_max_input_buffers``, but the reduce-scatter reads the comm context's
    (``FSDPParamGroup.post_backward``: ``comm_ctx.reduce_scatter_max_input_buffers``), which the root's lazy init
    sets once, to the largest of the groups' (``FSDPState._init_shared_state``). So: the comm context's value
    once the root ran its first forward, the groups' before (what the lazy init will take).
    """
    if lazily_initialized(module):
        state = module._get_fsdp_state()
        return int(state._comm_ctx.reduce_scatter_max_input_buffers) if param_groups(module) else None
    return _groups_agree(module, lambda g: int(g.reduce_scatter_max_input_buffers))


def reduce_scatter_max_input_buffers_setter(model: nn.Module) -> Callable[[int], None]:
    """The setter of a plan's ``reduce_scatter_max_input_buffers`` for every FSDP module under the root ``model``,
    at any point in training.

    Why: the public ``set_reduce_scatter_max_input_buffers`` writes the parameter groups only, which FSDP2 reads
    once, at the root's lazy init (:func:`reduce_scatter_max_input_buffers`); after it, the setter alone changes
    nothing FSDP2 acts on. So the root's comm context (``FSDPState._comm_ctx``, shared by every state from the
    lazy init) is set too. Lowered while more buffers are in flight, the next ``post_backward`` drops the oldest
    until the new cap holds.
    """
    public = getattr(model, "set_reduce_scatter_max_input_buffers", None)
    if public is None:
        raise UnsupportedPlanError(
            f"the plan sets reduce_scatter_max_input_buffers, but torch {torch.__version__} has no "
            f"FSDPModule.set_reduce_scatter_max_input_buffers ({TESTED_ADVICE} or use a plan without it)")

    def set_buffers(value: int) -> None:
        public(value)
        if lazily_initialized(model):
            model._get_fsdp_state()._comm_ctx.reduce_scatter_max_input_buffers = value

    return set_buffers


def unshard_in_backward(module: nn.Module) -> bool | None:
    """``FSDPParamGroup.unshard_in_backward`` (``set_unshard_in_backward``), read at each pre-backward."""
    return _groups_agree(module, lambda g: bool(g.unshard_in_backward))


def separate_reduce_scatter_group(module: nn.Module) -> bool | None:
    """Whether an FSDP module's reduce-scatter runs on a process group of its own: ``FSDPMeshInfo
    .reduce_scatter_process_group`` set (``set_separate_reduce_scatter_group``,
    ``FSDPParamGroup._set_separate_reduce_scatter_group``), read at each reduce-scatter
    (``FSDPParamGroup._reduce_scatter_process_group``)."""
    def read(group: FSDPParamGroup) -> bool:
        if not hasattr(group.mesh_info, "reduce_scatter_process_group"):
            raise UnknownState("FSDPMeshInfo.reduce_scatter_process_group")  # a torch without the knob
        return group.mesh_info.reduce_scatter_process_group is not None

    return _groups_agree(module, read)


# FSDP2's own comms (``_fsdp_collectives``): anything else on a parameter group was set by the user
# (``set_custom_all_gather``, ``set_custom_reduce_scatter``) or is symmetric memory (``set_symm_mem_for_comm``).
_OWN_ALL_GATHERS = ("DefaultAllGather", "ProcessGroupAllocAllGather")
_OWN_REDUCE_SCATTERS = ("DefaultReduceScatter", "ProcessGroupAllocReduceScatter")


def custom_comms(module: nn.Module) -> tuple[str, ...]:
    """The class names of the comms on ``module``'s parameter groups that are neither FSDP2's default nor its
    process-group-allocated one (a custom all-gather or reduce-scatter, or symmetric memory), in order; empty if
    none.

    Why: ``set_allocate_memory_from_process_group_for_comm`` replaces both comms and asserts on any other
    (``FSDPParamGroup.set_allocate_memory_from_process_group``), and FSDP2 refuses more than one reduce-scatter
    input buffer with the symmetric-memory reduce-scatter (``_validate_reduce_scatter_max_input_buffers``);
    ``FSDPParamGroup._all_gather_comm`` and ``_reduce_scatter_comm`` have no public accessor.
    """
    out: list[str] = []
    for group in param_groups(module):
        for comm, own in ((group._all_gather_comm, _OWN_ALL_GATHERS),
                          (group._reduce_scatter_comm, _OWN_REDUCE_SCATTERS)):
            if type(comm).__name__ not in own and type(comm).__name__ not in out:
                out.append(type(comm).__name__)
    return tuple(out)


def allocates_from_process_group(module: nn.Module) -> bool | None:
    """Whether an FSDP module's collectives take their buffers from the process group's allocator
    (``set_allocate_memory_from_process_group_for_comm``: ``FSDPParamGroup._all_gather_comm`` a
    ``ProcessGroupAllocAllGather``), read at each all-gather.

    Raises:
        UnknownState: a custom comm (:func:`custom_comms`) replaced FSDP2's.
    """
    custom = custom_comms(module)
    if custom:
        raise UnknownState(f"a custom comm ({', '.join(custom)})")
    return _groups_agree(module, lambda g: type(g._all_gather_comm).__name__ == "ProcessGroupAllocAllGather")


