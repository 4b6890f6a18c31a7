"""Rank script: a user's plain training loop under torch.profiler, one trace per rank (tensorboard_trace_handler).

argv: factory, kwargs JSON, microbatches, active steps, output folder. Rank 0 also writes the model's own
fingerprint (``runtime.apply.model_fingerprint``) to ``<folder>/fingerprint.json``.
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from runtime.apply import model_fingerprint
from runtime.ranks.rank import init_rank, shutdown_rank
from runtime.workload import build_workload, train_step

factory, kwargs, microbatches, active, folder = (sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]),
                                                 int(sys.argv[4]), Path(sys.argv[5]))
mesh = init_rank("gloo")
workload = build_workload(factory, mesh, kwargs, microbatches)
for step in range(2):
    train_step(workload, step)
handler = torch.profiler.tensorboard_trace_handler(str(folder / "traces"), worker_name=f"rank{dist.get_rank()}")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                            schedule=torch.profiler.schedule(wait=0, warmup=1, active=active),
                            on_trace_ready=handler) as prof:
    for step in range(active + 1):
        train_step(workload, 2 + step)
        prof.step()
if dist.get_rank() == 0:
    (folder / "fingerprint.json").write_text(json.dumps(dataclasses.asdict(model_fingerprint(workload.model))))
shutdown_rank()
