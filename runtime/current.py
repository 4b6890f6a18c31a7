"""Read back the plan a model has: what FSDP2 was told, by the user's code or by an earlier ``apply_plan``.

[Note: The plan a model arrived with]
FSDP2 has setters and no getters, so a model's configuration is read from the
state each setter writes (``runtime.ranks.torch_private``, one reader per
knob named beside its setter in ``planner.artifacts.knobs``): the explicit
prefetch lists (``FSDPState._states_to_forward_prefetch``,
``_states_to_backward_prefetch``), ``reshard_after_forward`` from each
parameter group's ``post_forward_mesh_info`` (an integer where the model was
wrapped with one), and each knob. A knob whose state the running torch does
not hold is *unknown*: the plan carries FSDP2's default for it and names it
in ``provenance.unknown_knobs``, and ``apply_plan`` leaves it alone, so
``apply_plan(model, current_plan(model))`` changes nothing. A knob of one
value per plan whose modules disagree (set on some modules only, by hand) is
unknown too: no plan can hold it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from torch import nn

from planner.artifacts.knobs import MODULE_KNOBS, PLAN_KNOBS, KnobValues, knob
from planner.artifacts.plan import ModulePlan, Plan, Provenance, Source
from planner.errors import NotShardedError
from runtime import knob_state
from runtime.apply import configure_plan, model_fingerprint
from runtime.ranks import torch_private
from runtime.workload import fsdp_modules

logger = logging.getLogger(__name__)

def current_plan(model: nn.Module) -> Plan:
    """The plan ``model`` has now ([Note: The plan a model arrived with]), of provenance ``user``.

    Args:
        model: the root FSDP module, after ``fully_shard``.

    Returns:
        Every FSDP module's explicit prefetch lists (FQNs, in the order FSDP2 issues them), its
        ``reshard_after_forward`` (``bool``, or the ``int`` it was wrapped with) and its module knobs, and the
        plan's knobs; ``provenance.unknown_knobs`` names what could not be read.

    Raises:
        NotShardedError: ``model`` has no FSDP module, or prefetches a module outside it.
    """
    modules = fsdp_modules(model)
    if not modules:
        raise NotShardedError(f"current_plan: {type(model).__name__} is not wrapped with fully_shard")
    fqn_of = {id(torch_private.fsdp_state(m)): fqn for fqn, m in modules}

    def fqns(states: list[Any], fqn: str) -> tuple[str, ...]:
        missing = [s for s in states if id(s) not in fqn_of]
        if missing:
            raise NotShardedError(f"current_plan: {fqn or 'the root'} prefetches an FSDP module outside this model")
        return tuple(fqn_of[id(s)] for s in states)

    unknown: list[str] = []
    module_values: dict[str, dict[str, Any]] = {fqn: {} for fqn, _ in modules}
    for k in MODULE_KNOBS:
        values = knob_state.module_values(k, modules)
        if values is None:
            unknown.append(k.name)
            continue
        for fqn, value in values.items():
            module_values[fqn][k.name] = k.default if value is None else value
    plan_values: dict[str, Any] = {}
    for k in PLAN_KNOBS:
        value = knob_state.plan_value(k, model, modules)
        if value is None:
            unknown.append(k.name)
        else:
            plan_values[k.name] = value
    out = {}
    for fqn, m in modules:
        forward, backward = torch_private.prefetch_states(m)
        out[fqn] = ModulePlan(fqns(forward, fqn), fqns(backward, fqn),
                              torch_private.reshard_after_forward_setting(m, root=m is model),
                              KnobValues(module_values[fqn], module=True))
    return Plan(model_fingerprint(model), out, KnobValues(plan_values),
                Provenance(source=Source.USER, unknown_knobs=tuple(unknown) or None))


def fsdp2_default(model: nn.Module) -> Plan:
    """FSDP2's default for ``model``, as ``fully_shard`` without arguments sets it and as :func:`current_plan` reads
    it: no explicit prefetch list, every module resharding after forward but the root, which keeps its parameters
    (``FSDPState._lazy_init``) and those without parameters of their own (nothing to reshard), every knob at its
    default."""
    fingerprint = model_fingerprint(model)
    own = dict(zip(fingerprint.module_fqns, fingerprint.param_numels, strict=True))
    return Plan(fingerprint, {fqn: ModulePlan(reshard_after_forward=fqn != "" and own[fqn] > 0)
                              for fqn in fingerprint.module_fqns})


def own_plan(model: nn.Module) -> Plan | None:
    """The plan ``model`` arrived with when it is not FSDP2's default (:func:`fsdp2_default`), else ``None``: what
    the profile must not be recorded under, and what ``check`` reads back."""
    plan = current_plan(model)
    return None if plan.behaviour_key() == fsdp2_default(model).behaviour_key() else plan


def record_under_fsdp2_default(model: nn.Module) -> Plan | None:
    """Before a profile is recorded: a model that arrived with a plan of its own gets FSDP2's default applied (a
    profile is FSDP2's default's), with one log line on rank 0 naming what it had. Returns that plan (``None``:
    the model had FSDP2's default); the caller applies it again where the model goes on training."""
    own = own_plan(model)
    if own is None:
        return None
    default = fsdp2_default(model)
    configure_plan(model, default, check=False)
    if not dist.is_initialized() or dist.get_rank() == 0:
        changed = sum(1 for fqn, m in own.modules.items() if m != default.modules.get(fqn))
        logger.info(f"the model arrives with a plan of its own ({changed} FSDP modules set other than FSDP2's "
                    f"default{', knobs ' + _changed_knobs(own) if _changed_knobs(own) else ''}): recorded under "
                    "FSDP2's default, as a profile is")
    return own


def _changed_knobs(plan: Plan) -> str:
    return ", ".join(f"{name} = {value!r}" for name, value in plan.knobs.items() if value != knob(name).default)
