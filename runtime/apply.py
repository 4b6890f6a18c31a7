"""Apply a Plan to an FSDP2 model through FSDP2's public setters.

``apply_plan(model, load_plan("plan.json"))`` at training start, after
``fully_shard`` and before the first forward (or between steps).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.knobs import KNOBS, Knob, Scope
from planner.artifacts.plan import Plan, Source
from planner.errors import PlanMismatchError, TensorParallelError, UnsupportedPlanError
from planner.switch import off_line, switched_off
from runtime import knob_state
from runtime.accumulation import set_accumulation
from runtime.post_optim import post_optim_event_setter
from runtime.ranks.torch_private import (
    TESTED_ADVICE,
    collective_dtypes,
    data_parallel_mesh,
    reduce_scatter_max_input_buffers_setter,
    separate_reduce_scatter_group_setter,
    set_reshard_after_forward_ranks,
    unshard_async_op_setter,
    unsharded_shapes,
)
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

    With ``PREFETCH_PLANNER=off`` no storage is opened: the plan that changes nothing, and one line on rank 0.

    Raises:
        planner.StudyNotFoundError: no database or no such study.
        planner.StorageError: the storage cannot be opened.
        planner.SwitchError: ``PREFETCH_PLANNER`` is neither on nor off.
    """
    from planner.study import best_plan_for  # the study driver (Optuna) only for the jobs that ask it

    fingerprint = model_fingerprint(model)
    if switched_off():
        _log_rank0(logging.WARNING, off_line("load_best_plan"))
        return Plan(fingerprint, {})
    plan, why = best_plan_for(storage_url, study_name, fingerprint)
    if plan is None:
        logger.info(f"load_best_plan: FSDP2's default: {why}")
        return Plan(fingerprint, {})
    logger.info(f"load_best_plan: {why}")
    return plan


def model_fingerprint(model: nn.Module, world_size: int | None = None) -> Fingerprint:
    """The :class:`planner.Fingerprint` of an FSDP-wrapped model.

    Per FSDP module: the parameters it manages itself (not those of nested
    FSDP modules), unsharded numel and bytes at the dtype FSDP2 all-gathers them in (its ``MixedPrecisionPolicy``'s
    ``param_dtype``, read from FSDP2's parameters: ``torch_private.collective_dtypes``); the mesh
    ``(replicate, shard)`` when FSDP2 shards them as HSDP, and the tensor-parallel degree under FSDP + TP, read
    from FSDP2's own mesh info (``torch_private.data_parallel_mesh``), never from a parameter's DTensor mesh,
    which under FSDP + TP is the (dp, tp) mesh. Under FSDP + TP a parameter's unsharded numel is its TP-local
    tensor's, what FSDP2 all-gathers over the dp ranks (``torch_private.unsharded_shapes``).

    Raises:
        TensorParallelError: HSDP + TP, or FSDP modules on different tensor-parallel degrees.
        UnsupportedPlanError: FSDP modules cast under different mixed-precision dtypes; FSDP2 shards over fewer
            ranks than the job has and no parameter is tensor-parallel (pipeline parallelism: the FSDP modules are
            one model part of several); a module's parameters on several meshes (``SeveralParamGroupsError``).
    """
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    modules = fsdp_modules(model)
    numels, nbytes, dtypes, device, mesh, casts = [], [], set(), "cpu", None, set()
    shards, degrees = set(), set()
    for fqn, m in modules:
        own = own_parameters(modules, fqn)
        shapes = unsharded_shapes(m)
        local = [shapes[id(p)].numel() if id(p) in shapes else p.numel() for p in own]
        numels.append(sum(local))
        moved = collective_dtypes(m)
        cast = moved is not None and (moved.all_gather, moved.reduce_scatter) != (moved.sharded, moved.sharded)
        itemsize = [moved.all_gather.itemsize if cast else p.element_size() for p in own]
        nbytes.append(sum(n * size for n, size in zip(local, itemsize, strict=True)))
        if moved is not None:
            casts.add((str(moved.all_gather), str(moved.reduce_scatter)) if cast else None)
        dtypes.update(str(p.dtype) for p in own)
        if own:
            device = own[0].device.type
        dp = data_parallel_mesh(m)
        if dp is None:
            continue
        if dp.tensor_parallel > 1 and dp.replicate_size is not None:
            raise TensorParallelError(
                f"FSDP module {fqn or 'root'!r} is sharded as HSDP with tensor parallelism (HSDP + TP): not tuned "
                "yet (docs/clusters.md, FSDP + TP jobs); tune FSDP + TP (one dp mesh dim), or keep your plan")
        if dp.replicate_size is not None:
            mesh = (dp.replicate_size, dp.shard_size)
        shards.add(dp.shard_size * (dp.replicate_size or 1))
        if dp.tensor_parallel > 1:
            degrees.add(dp.tensor_parallel)
    if len(casts) > 1:
        raise UnsupportedPlanError(
            "FSDP modules cast under different mixed-precision dtypes (" + "; ".join(
                f"{c[0]} all-gather, {c[1]} reduce-scatter" if c else "no cast" for c in sorted(casts, key=str))
            + "): not tuned yet; give every fully_shard call one MixedPrecisionPolicy")
    if len(degrees) > 1:
        raise TensorParallelError(f"FSDP modules shard parameters of tensor-parallel degrees {sorted(degrees)}: not "
                                  "tuned; give every tensor-parallel module one TP mesh")
    tensor_parallel = next(iter(degrees), None)
    data_parallel = max(shards, default=world_size)
    if shards and data_parallel * (tensor_parallel or 1) != world_size:
        raise UnsupportedPlanError(
            f"FSDP shards over {data_parallel} of this job's {world_size} ranks"
            + (f" with tensor-parallel degree {tensor_parallel}" if tensor_parallel else "")
            + ", so the model is one part of several (pipeline parallelism, or another layout across ranks): not "
            "tuned; tune one part's layout, FSDP (or FSDP + TP) over every rank of the job")
    return Fingerprint(
        module_fqns=tuple(f for f, _ in modules),
        param_numels=tuple(numels),
        param_bytes=tuple(nbytes),
        world_size=world_size,
        device_type=device,
        param_dtypes=tuple(sorted(dtypes)),
        torch_version=torch.__version__,
        mesh=mesh,
        mixed_precision=next(iter(casts), None),  # one policy for every module, or none
        tensor_parallel=tensor_parallel,
    )


def apply_plan(model: nn.Module, plan: Plan, check: bool = True) -> None:
    """Configure FSDP2 on ``model`` as ``plan`` says (:func:`configure_plan`), unless ``PREFETCH_PLANNER=off``: then
    nothing is applied and rank 0 logs one line (:mod:`planner.switch`; set it on every node, [Note: The ranks agree
    on the switch]). The entry point of a training script; the tuner's own work calls :func:`configure_plan`.

    Raises:
        SwitchError: ``PREFETCH_PLANNER`` is neither on nor off.
        PlanMismatchError, UnsupportedPlanError: as :func:`configure_plan`.
    """
    if switched_off():
        _log_rank0(logging.WARNING, off_line("apply_plan"))
        return
    configure_plan(model, plan, check)
    _log_rank0(logging.WARNING, f"apply_plan: {plan.name()} applied")


def _log_rank0(level: int, line: str) -> None:
    """``line`` at ``level`` on rank 0 (every process without a process group): one line per job, not per rank."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.log(level, line)


def configure_plan(model: nn.Module, plan: Plan, check: bool = True) -> None:
    """Configure FSDP2 on ``model`` as ``plan`` says, whatever ``PREFETCH_PLANNER`` holds (the tuner's own work and
    the commands a user runs by hand; a training script calls :func:`apply_plan`).

    Calls, per FSDP module: ``set_modules_to_forward_prefetch``,
    ``set_modules_to_backward_prefetch`` and ``set_reshard_after_forward``
    (not recursive); then each knob's setter (``planner.artifacts.knobs.KNOBS``:
    on the root, on every FSDP module, or per module with its own value),
    through :data:`ROOT_SETTERS` where FSDP2's setter needs a wrapper (keyed by knob). Every
    knob the running torch has is set, to FSDP2's default where the
    plan leaves it, so applying a plan replaces the previous one entirely, before the first forward or between
    any two steps; a setter whose value FSDP2 already acts on is not called (``runtime.knob_state``).
    A plan read back from a model (``runtime.current_plan``) leaves alone the
    knobs it could not read (``provenance.unknown_knobs``), and a knob the model's own comms block is left as the
    model has it, with one log line ([Note: What blocks a knob] in ``runtime.knob_state``). An integer
    ``reshard_after_forward`` reshards to that many ranks, as
    ``fully_shard(reshard_after_forward=int)`` does
    (``runtime.ranks.torch_private.set_reshard_after_forward_ranks``).

    Args:
        model: the root FSDP module.
        plan: the plan; its fingerprint must match the model.
        check: compare fingerprints first (turn off only when re-applying a
            plan already checked against this model).

    A plan made at another world size applies, with a one-line warning that its gain was confirmed there, not
    here ([Note: Plans travel] in ``planner.artifacts.plan``); a plan of provenance ``predicted`` (``tune
    --target``) applies with a warning that it was never measured.

    Raises:
        PlanMismatchError: the plan was made for another model; the message names the first difference.
        UnsupportedPlanError: the plan sets a knob the running torch has no
            setter for (the message names the knob, the setter and the torch
            version); nothing is applied.
    """
    modules = dict(fsdp_modules(model))
    unknown = set(plan.provenance.unknown_knobs or ())
    # before any call: all or nothing
    setters = {k.name: _setter(model, k, _values(plan, k)) for k in KNOBS if k.name not in unknown}
    if check:
        fingerprint = model_fingerprint(model)
        difference = plan.fingerprint.model_difference(fingerprint)
        if difference is not None:
            raise PlanMismatchError(f"plan does not match this model: {difference}; tune a plan for this model")
        note = plan.fingerprint.travel_note(fingerprint)
        if note is not None:
            _log_rank0(logging.WARNING, note)
        if plan.provenance.source == Source.PREDICTED:
            _log_rank0(logging.WARNING, f"plan predicted for {plan.provenance.target or 'another cluster'}, not "
                       "measured: confirm it here (AutoTuner(..., start_from=PLAN_JSON) races it against FSDP2's "
                       "default)")
    for fqn, module in modules.items():
        mp = plan.modules.get(fqn)
        if mp is None:
            continue
        module.set_modules_to_forward_prefetch([modules[t] for t in mp.forward_prefetch])
        module.set_modules_to_backward_prefetch([modules[t] for t in mp.backward_prefetch])
        if isinstance(mp.reshard_after_forward, bool):
            module.set_reshard_after_forward(mp.reshard_after_forward, recurse=False)
        else:
            set_reshard_after_forward_ranks(module, mp.reshard_after_forward)
    for k in KNOBS:
        set_value = setters.get(k.name)
        if set_value is None:  # torch lacks it and the plan keeps FSDP2's default, or the plan could not read it
            continue
        if k.scope is Scope.ROOT:
            value = plan.knobs[k.name]
            if not _left_alone(model, k, list(modules.values()), value) and (
                    knob_state.plan_value(k, model, list(modules.items())) != value):
                set_value(model, value)
            continue
        for fqn, module in modules.items():
            if k.scope is Scope.MODULE and fqn not in plan.modules:
                continue
            value = plan.knobs[k.name] if k.scope is Scope.EVERY_MODULE else plan.modules[fqn].knobs[k.name]
            if not _left_alone(model, k, [module], value) and not knob_state.unchanged(k, module, value):
                set_value(module, value)


# root model -> the (knob, reason) pairs already logged as left alone: one line per model and knob, not one per
# plan switch of a race.
_LOGGED: weakref.WeakKeyDictionary[nn.Module, set[tuple[str, str]]] = weakref.WeakKeyDictionary()


def _left_alone(model: nn.Module, k: Knob, modules: list[nn.Module], value: Any) -> bool:
    """Whether knob ``k`` is blocked from taking ``value`` on ``modules`` ([Note: What blocks a knob] in
    ``runtime.knob_state``); logs why, once per model and knob."""
    why = knob_state.blocked(k, modules, value)
    if why is None:
        return False
    logged = _LOGGED.setdefault(model, set())
    if (k.name, why) not in logged:
        logged.add((k.name, why))
        _log_rank0(logging.INFO, f"apply_plan: {k.name} left as the model has it: {why}")
    return True


ROOT_SETTERS: dict[str, Callable[[nn.Module], Callable[[Any], None]]] = {
    "unshard_async_op": unshard_async_op_setter,
    "reduce_scatter_max_input_buffers": reduce_scatter_max_input_buffers_setter,
    "separate_reduce_scatter_group": separate_reduce_scatter_group_setter,
    "reshard_after_backward": lambda model: functools.partial(set_accumulation, model),
    "post_optim_event": post_optim_event_setter,
}
"""The knobs (by ``Knob.name``) applied on the root through ``runtime``'s own wrappers instead of the bare
``Knob.setter``: the private async-op setter, the reduce-scatter buffers set where FSDP2 reads them after its lazy
init too (the root's comm context), a reduce-scatter group made once per model, the per-microbatch resharding of
gradient accumulation (:func:`runtime.accumulation.prepare_microbatch` sets it before each microbatch but the last),
and the post-optimizer event handed to FSDP2 after every optimizer step (:mod:`runtime.post_optim`)."""


def _values(plan: Plan, k: Knob) -> list[Any]:
    """The plan's values of knob ``k``: one, or one per module."""
    return [m.knobs[k.name] for m in plan.modules.values()] if k.scope is Scope.MODULE else [plan.knobs[k.name]]


def _setter(model: nn.Module, k: Knob, values: list[Any]) -> Callable[[nn.Module, Any], None] | None:
    """How to apply knob ``k``: ``(module, value) -> None``; ``None`` where the running torch lacks its setter and
    every one of ``values`` (the plan's) is FSDP2's default.

    Raises:
        UnsupportedPlanError: torch lacks the setter and the plan sets another value.
    """
    wrapper = ROOT_SETTERS.get(k.name)
    if wrapper is not None and (hasattr(model, k.setter) or any(v != k.default for v in values)):
        wrapped = wrapper(model)  # raises UnsupportedPlanError naming the setter where torch lacks it
        return lambda _module, value: wrapped(value)
    if hasattr(model, k.setter):
        return lambda module, value: getattr(module, k.setter)(value)
    changed = [v for v in values if v != k.default]
    if changed:
        raise UnsupportedPlanError(
            f"the plan sets {k.name} = {changed[0]!r}, but torch {torch.__version__} has no "
            f"FSDPModule.{k.setter} ({TESTED_ADVICE} or use a plan that keeps FSDP2's default, {k.default!r})")
    return None
