"""Rank script: a property-based test run across ranks.

Rank 0 runs a Hypothesis test that draws plans from every search space (each
space's own ``suggest``, fed by Hypothesis instead of an Optuna sampler) plus
the knobs a space does not search here (``reshard_after_forward`` per module,
every plan knob of ``planner.artifacts.knobs`` the space did not draw, those
for GPUs included, and the module knobs where a module admits them), and
broadcasts each example, shrinking included,
to the other ranks. Every rank trains ``steps`` steps on a fresh model with
the plan; the property: each rank's losses are bitwise those of FSDP2's
default, and the plan read back from the model (``runtime.current_plan``)
is the plan applied, before the steps and after, and applying it again
changes nothing.

argv: factory, kwargs JSON, steps, max_examples, output JSON, microbatches
per step (gradient accumulation; only the last syncs gradients), and optionally
the layout as JSON: an HSDP mesh (``[replicate, shard]``), or FSDP + TP's degree (``{"tensor_parallel": 2}``,
the ``(dp, tp)`` mesh of ``[launch] tensor_parallel``). Rank 0 writes
{"examples": n, "spaces": {space: n}, "failure": null | text}.
"""

import dataclasses
import json
import sys
from collections import Counter

import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.artifacts import knobs
from planner.artifacts.knobs import MODULE_KNOBS, PLAN_KNOBS
from planner.artifacts.names import SpaceName
from planner.artifacts.plan import Plan
from runtime import apply_plan, current_plan
from runtime.ranks.rank import init_rank, shutdown_rank
from runtime.recording.recorder import record_profile
from runtime.workload import build_workload, train_step
from search_spaces import SPACES

factory, kwargs, steps, max_examples, out, microbatches = (
    sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], int(sys.argv[6]))
layout = json.loads(sys.argv[7]) if len(sys.argv) > 7 else None
hsdp = layout if isinstance(layout, list) else None
tensor_parallel = layout.get("tensor_parallel", 1) if isinstance(layout, dict) else 1
mesh = init_rank("gloo", mesh=hsdp, tensor_parallel=tensor_parallel)
profile = record_profile(build_workload(factory, mesh, kwargs, microbatches), warmup_steps=1, steps=1, repeats=1)
assert profile.microbatches == microbatches  # the recorder records the accumulation
assert profile.fingerprint.mesh == (None if hsdp is None else tuple(hsdp))  # and the mesh
assert (profile.fingerprint.tensor_parallel or 1) == tensor_parallel  # and the TP degree


def as_held(plan: Plan) -> str:
    """``plan``'s behaviour key as FSDP2 holds it: a module without parameters of its own keeps none after forward
    whatever it is told (its setter has no parameter group to set)."""
    own = dict(zip(plan.fingerprint.module_fqns, plan.fingerprint.param_numels, strict=True))
    return dataclasses.replace(plan, modules={
        fqn: m if own[fqn] else dataclasses.replace(m, reshard_after_forward=False)
        for fqn, m in plan.modules.items()}).behaviour_key()


def losses(plan: Plan) -> list[list[str]]:
    """Every rank's losses (float hex) over ``steps`` steps on a fresh model with ``plan``; a rank whose model does
    not read back as ``plan`` (``current_plan``, before and after the steps and after applying what it read)
    puts the difference in place of its losses."""
    workload = build_workload(factory, mesh, kwargs, microbatches)
    apply_plan(workload.model, plan)
    read = current_plan(workload.model)
    local = [train_step(workload, s).double().item().hex() for s in range(steps)]
    apply_plan(workload.model, current_plan(workload.model))
    again = current_plan(workload.model)
    if not as_held(plan) == read.behaviour_key() == again.behaviour_key():
        local = [f"current_plan read {read.to_dict()['modules']} (then {again.to_dict()['modules']}) after "
                 f"applying {plan.to_dict()['modules']}"]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return gathered


def share(plan_dict):
    box = [plan_dict]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class DrawingTrial:
    """The part of ``optuna.Trial`` a search space uses, drawing values with Hypothesis."""

    def __init__(self, draw):
        self.draw = draw

    def suggest_int(self, name, low, high):
        return self.draw(st.integers(low, high), label=name)

    def suggest_categorical(self, name, choices):
        return self.draw(st.sampled_from(choices), label=name)


reference = losses(Plan.default(profile))
if dist.get_rank() == 0:
    seen: Counter = Counter()

    def for_space(space):
        """The property, every plan drawn from ``space``."""
        @settings(max_examples=-(-max_examples // len(SPACES)), deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(st.data())
        def property_bitwise_loss(data):
            plan = SPACES[space].suggest(DrawingTrial(data.draw), profile)
            modules = {fqn: dataclasses.replace(m, reshard_after_forward=data.draw(st.booleans(), label=f"raf:{fqn}"))
                       for fqn, m in plan.modules.items()}
            drawn = {k.name: data.draw(st.sampled_from(k.choices), label=k.name) for k in PLAN_KNOBS
                     if not knobs.sampled(k, profile.fingerprint.device_type, microbatches, space=SpaceName(space))}
            plan = dataclasses.replace(plan, modules=modules).with_knobs(**drawn)
            if space != "assign":  # the module knobs where a space may set them (assign draws its own)
                plan = dataclasses.replace(plan, modules={fqn: m.with_knobs(**{
                    k.name: data.draw(st.sampled_from(k.choices), label=f"{k.param}:{fqn}") for k in MODULE_KNOBS
                    if knobs.sampled(k, profile.fingerprint.device_type, microbatches,
                                     not profile.modules[fqn].needs_parameters_in_backward)}) for fqn, m in
                    plan.modules.items()})
            seen["reshard_after_backward=False"] += not plan.reshard_after_backward
            seen["post_optim_event"] += plan.knobs.post_optim_event
            seen["unshard_in_backward=False"] += not all(m.knobs.unshard_in_backward for m in plan.modules.values())
            plan.validate()
            seen[space] += 1
            got = losses(Plan.from_dict(share(plan.to_dict())))
            assert got == reference, f"losses {got} differ from the default's {reference}"
        return property_bitwise_loss

    failure = None
    try:
        for space in sorted(SPACES):  # every space, each its share of the examples
            for_space(space)()
    except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
        failure = f"{type(e).__name__}: {e}"
    finally:
        share(None)
    with open(out, "w") as f:
        json.dump({"examples": sum(seen[s] for s in SPACES), "spaces": {s: seen[s] for s in SPACES if seen[s]},
                   "mesh": profile.fingerprint.mesh, "tensor_parallel": profile.fingerprint.tensor_parallel,
                   "no_reshard_after_backward": seen["reshard_after_backward=False"],
                   "no_unshard_in_backward": seen["unshard_in_backward=False"],
                   "post_optim_event": seen["post_optim_event"], "failure": failure}, f)
else:
    while (d := share(None)) is not None:
        losses(Plan.from_dict(d))
shutdown_rank()
