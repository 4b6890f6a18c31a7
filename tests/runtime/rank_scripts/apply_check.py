"""Rank script: load a tuned plan at training start in a fresh process group.

argv: plan JSON, factory, kwargs JSON, output JSON.
"""

import dataclasses
import json
import logging
import sys

import torch.distributed as dist

from runtime import PlanMismatchError, apply_plan, load_plan
from runtime.ranks.rank import init_rank, shutdown_rank
from runtime.ranks.torch_private import prefetch_counts, unshard_async_op
from runtime.workload import build_workload, fsdp_modules, train_step

plan_path, factory, kwargs, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
mesh = init_rank("gloo")
plan = load_plan(plan_path)
workload = build_workload(factory, mesh, kwargs)
apply_plan(workload.model, plan)
modules = dict(fsdp_modules(workload.model))
applied = {fqn: list(prefetch_counts(m)) for fqn, m in modules.items()}
async_ops = sorted({unshard_async_op(m) for m in modules.values()})
losses = [train_step(workload, s).item() for s in range(2)]
errors = {}
other = build_workload(factory, mesh, {**kwargs, "layers": kwargs.get("layers", 4) - 1})
try:
    apply_plan(other.model, plan)
except PlanMismatchError as e:
    errors["model"] = str(e)
travelled = []  # a plan from another world size applies, with one warning on rank 0, then the applied plan's line


class Kept(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        travelled.append(record.getMessage())


logging.getLogger("runtime.apply").addHandler(Kept())
other_world = dataclasses.replace(plan, fingerprint=dataclasses.replace(plan.fingerprint, world_size=4))
apply_plan(workload.model, other_world)
travelled_applied = {fqn: list(prefetch_counts(m)) for fqn, m in fsdp_modules(workload.model)}
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump({"applied": applied, "async": async_ops, "losses": losses, "errors": errors,
                   "travelled": travelled, "travelled_applied": travelled_applied}, f)
del workload, other
shutdown_rank()
