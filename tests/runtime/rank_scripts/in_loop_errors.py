"""Rank script: what AutoTuner refuses before any step. argv: storage URL of a study tuned for the MLP of
tests/runtime/in_loop/test_autotuner.py, output JSON. Rank 0 writes {case: [exception type, message]}."""

import json
import sys

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from runtime import AutoTuner
from runtime.ranks.rank import init_rank, shutdown_rank
from runtime.workload import build_workload

storage, out = sys.argv[1], sys.argv[2]
mesh = init_rank("gloo")
cases = {
    "plain": lambda: nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)),
    "root_only": lambda: fully_shard(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), mesh=mesh),
    "another_model": lambda: build_workload("runtime.reference_workloads:mlp", mesh, {"dim": 32, "layers": 3}).model,
}
result = {}
for name, build in cases.items():
    try:
        AutoTuner(build(), study="in-loop", storage=storage)
        result[name] = None
    except Exception as e:  # noqa: BLE001 - the test reads the type
        result[name] = [type(e).__name__, str(e)]
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump(result, f)
shutdown_rank()
