"""Rank script: losses over N steps for several plans, each on a fresh model.

argv: factory, kwargs JSON, steps, output JSON[, plan JSON: a study's plan, run as "study"]. Rank 0 writes
{plan name: [[loss hex per step] per rank]}. ``TEST_MESH`` (``[replicate, shard]`` as JSON): shard as HSDP;
``TEST_TENSOR_PARALLEL`` (a TP degree): FSDP + TP's ``(dp, tp)`` mesh (``[launch] tensor_parallel``).
"""

import json
import os
import sys

import torch.distributed as dist

from planner.artifacts.plan import Plan
from runtime import apply_plan
from runtime.ranks.rank import init_rank, shutdown_rank
from runtime.recording.recorder import record_profile
from runtime.workload import build_workload, train_step
from search_spaces import per_module, uniform

factory, kwargs, steps, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
mesh = init_rank("gloo", mesh=json.loads(os.environ.get("TEST_MESH", "null")),
                 tensor_parallel=int(os.environ.get("TEST_TENSOR_PARALLEL", "1")))
# A profile gives the orders the search spaces need (on a throwaway model).
profile = record_profile(build_workload(factory, mesh, kwargs), warmup_steps=1, steps=1, repeats=1)
fqns = list(dict.fromkeys(profile.pre_forward_order))
default = Plan.default(profile)
keep = {f: m.__class__(m.forward_prefetch, m.backward_prefetch, False) for f, m in default.modules.items()}
plans = {
    "default": default,
    "tuned": uniform.build(profile, 1, 2).with_knobs(unshard_async_op=True),
    "deep": per_module.build(profile, {f: 3 for f in fqns}, {f: 3 for f in fqns}).with_knobs(unshard_async_op=True),
    "sync_explicit": uniform.build(profile, 2, 3),
    "no_reshard": default.__class__(default.fingerprint, keep).with_knobs(unshard_async_op=True),
}
if len(sys.argv) > 5:
    plans["study"] = Plan.load(sys.argv[5])
result = {}
for name, plan in plans.items():
    workload = build_workload(factory, mesh, kwargs)
    apply_plan(workload.model, plan)
    local = [train_step(workload, s).double().item().hex() for s in range(steps)]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    result[name] = gathered
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump(result, f)
del workload
shutdown_rank()
