"""Apply a Plan to an FSDP2 model through FSDP2's public setters.

``apply_plan(model, load_plan("plan.json"))`` at training start, after
``fully_shard`` and before the first forward (or between steps).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.plan import Plan
from planner.errors import PlanMismatchError, UnsupportedPlanError
from runtime.accumulation import set_accumulation
from runtime.torch_private import TESTED_ADVICE, separate_reduce_scatter_group_setter, unshard_async_op_setter
from runtime.workload import fsdp_modules, own_parameters

logger = logging.getLogger(__name__)


def load_plan(path: str | Path) -> Plan:
    """Read a plan JSON file.

    Raises:
        planner.PlanFormatError: unreadable, malformed JSON, unknown schema
            version, or FQNs that are not modules of the plan's fingerprint.
    """
    return Plan.load(path)


def load_best_plan(storage_url: str, study_name: str, model: nn.Module) -> Plan:
    """The study's best plan confirmed faster than FSDP2's default for this model and world size, else the default.

    For a training job on a cluster: no plan file to copy around. The
    storage is opened read-only (``planner.storages.open_storage_read_only``),
    so many jobs can ask at once and none writes. A log line (logger
    ``runtime.apply``) says which plan it is, or why FSDP2's default.

    Args:
        storage_url: the study's SQLAlchemy URL (SQLite or PostgreSQL).
        study_name: ``[study] name``.
        model: the root FSDP module, after ``fully_shard`` (its fingerprint selects the plan).

    Returns:
        The plan; FSDP2's default is a plan that changes nothing (every module
        as wrapped, synchronous unshard): :func:`apply_plan` takes either.

    Raises:
        planner.StudyNotFoundError: no database or no such study.
        planner.StorageError: the storage cannot be opened.
    """
    from planner.study import best_plan_for  # the study driver (Optuna) only for the jobs that ask it

    fingerprint = model_fingerprint(model)
    plan, why = best_plan_for(storage_url, study_name, fingerprint)
    if plan is None:
        logger.info(f"load_best_plan: FSDP2's default: {why}")
        return Plan(fingerprint, {})
    logger.info(f"load_best_plan: {why}")
    return plan


def model_fingerprint(model: nn.Module, world_size: int | None = None) -> Fingerprint:
    """The :class:`planner.Fingerprint` of an FSDP-wrapped model.

    Per FSDP module: the parameters it manages itself (not those of nested
    FSDP modules), unsharded numel and bytes.
    """
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    modules = fsdp_modules(model)
    numels, nbytes, dtypes, device = [], [], set(), "cpu"
    for fqn, _ in modules:
        own = own_parameters(modules, fqn)
        numels.append(sum(p.numel() for p in own))
        nbytes.append(sum(p.numel() * p.element_size() for p in own))
        dtypes.update(str(p.dtype) for p in own)
        if own:
            device = own[0].device.type
    return Fingerprint(
        module_fqns=tuple(f for f, _ in modules),
        param_numels=tuple(numels),
        param_bytes=tuple(nbytes),
        world_size=world_size,
        device_type=device,
        param_dtypes=tuple(sorted(dtypes)),
        torch_version=torch.__version__,
    )


def apply_plan(model: nn.Module, plan: Plan, check: bool = True) -> None:
    """Configure FSDP2 on ``model`` as ``plan`` says.

    Calls, per FSDP module: ``set_modules_to_forward_prefetch``,
    ``set_modules_to_backward_prefetch``, ``set_reshard_after_forward``
    (not recursive), ``set_unshard_in_backward``; on the root: ``_set_unshard_async_op``
    (:func:`runtime.torch_private.unshard_async_op_setter`) and
    ``set_reduce_scatter_max_input_buffers`` and
    ``set_separate_reduce_scatter_group``
    (:func:`runtime.torch_private.separate_reduce_scatter_group_setter`); and records
    ``reshard_after_backward`` for gradient accumulation, which
    :func:`runtime.accumulation.prepare_microbatch` sets before each
    microbatch but the last. Applying a plan replaces the
    previous one entirely (empty lists restore FSDP2's defaults).

    Args:
        model: the root FSDP module.
        plan: the plan; its fingerprint must match the model.
        check: compare fingerprints first (turn off only when re-applying a
            plan already checked against this model).

    Raises:
        PlanMismatchError: the plan was made for another model or world size;
            the message names the first difference.
        UnsupportedPlanError: the plan uses a setting the running torch does
            not have (the message names the torch version); nothing is applied.
    """
    modules = dict(fsdp_modules(model))
    set_async_op = unshard_async_op_setter(model)
    set_separate_rs = None  # also switched off by a plan without it, after one with it (raises if torch lacks it)
    if plan.separate_reduce_scatter_group or hasattr(model, "set_separate_reduce_scatter_group"):
        set_separate_rs = separate_reduce_scatter_group_setter(model)
    rs_buffers = getattr(model, "set_reduce_scatter_max_input_buffers", None)
    if rs_buffers is None and plan.reduce_scatter_max_input_buffers != 1:
        raise UnsupportedPlanError(
            f"the plan sets reduce_scatter_max_input_buffers = {plan.reduce_scatter_max_input_buffers}, but torch "
            f"{torch.__version__} has no FSDPModule.set_reduce_scatter_max_input_buffers "
            f"({TESTED_ADVICE} or use a plan with 1 input buffer)"
        )
    has_unshard_in_backward = hasattr(model, "set_unshard_in_backward")
    if not has_unshard_in_backward and not all(m.unshard_in_backward for m in plan.modules.values()):
        raise UnsupportedPlanError(
            f"the plan turns unshard_in_backward off, but torch {torch.__version__} has no "
            f"FSDPModule.set_unshard_in_backward ({TESTED_ADVICE})"
        )
    if check:
        difference = plan.fingerprint.first_difference(model_fingerprint(model))
        if difference is not None:
            raise PlanMismatchError(
                f"plan does not match this model: {difference}; tune a plan for this model and world size"
            )
    for fqn, module in modules.items():
        mp = plan.modules.get(fqn)
        if mp is None:
            continue
        module.set_modules_to_forward_prefetch([modules[t] for t in mp.forward_prefetch])
        module.set_modules_to_backward_prefetch([modules[t] for t in mp.backward_prefetch])
        module.set_reshard_after_forward(mp.reshard_after_forward, recurse=False)
        if has_unshard_in_backward:
            module.set_unshard_in_backward(mp.unshard_in_backward)
    set_async_op(plan.unshard_async_op)
    if set_separate_rs is not None:
        set_separate_rs(plan.separate_reduce_scatter_group)
    set_accumulation(model, plan.reshard_after_backward)
    if rs_buffers is not None:  # without it FSDP2 always has 1, which the plan then asks for
        rs_buffers(plan.reduce_scatter_max_input_buffers)

