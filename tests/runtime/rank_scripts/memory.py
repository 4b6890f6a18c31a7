"""Rank script: tracked unsharded bytes vs the simulator's prediction, per plan.

argv: output JSON. Rank 0 writes {plan: [measured peak bytes, predicted peak bytes]} and, under "in_step", the
profile's in-step timings (its default step and the async default's, ms), and under "usage" the allocator, page faults
and kernel ms of its default step.
"""

import json
import sys

import torch.distributed as dist

from planner.artifacts.plan import Plan
from planner.simulation.parameters import simulate
from runtime.apply import apply_plan
from runtime.ranks.rank import init_rank, shutdown_rank
from runtime.recording.memory import UnshardedBytesTracker
from runtime.recording.recorder import record_profile
from runtime.workload import build_workload, train_step
from search_spaces import uniform

mesh = init_rank("gloo")
workload = build_workload("runtime.reference_workloads:mlp", mesh, {"dim": 64, "layers": 5})
profile = record_profile(workload, warmup_steps=1, steps=1, repeats=1)
plans = {
    "default": Plan.default(profile),
    "depth 1 async": uniform.build(profile, 1, 1).with_knobs(unshard_async_op=True),
    "depth 2 async": uniform.build(profile, 2, 2).with_knobs(unshard_async_op=True),
    "depth 3 sync": uniform.build(profile, 3, 3),
}
result = {}
for name, plan in plans.items():
    apply_plan(workload.model, plan)
    with UnshardedBytesTracker() as tracker:
        train_step(workload, 0)
    result[name] = [tracker.peak_bytes, simulate(profile, plan).peak_unsharded_bytes]
result["in_step"] = [profile.in_step.default_step_ms, profile.in_step.async_default_step_ms]
in_step = profile.in_step
result["usage"] = [in_step.allocator, in_step.default_step_faults, in_step.default_step_kernel_ms]
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)
del workload
shutdown_rank()
