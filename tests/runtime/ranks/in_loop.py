"""Rank script: a user's own training loop, without and with ``runtime.AutoTuner``, losses step by step.

argv: factory, kwargs JSON, steps, microbatches, storage URL (or "none"), output JSON, then AutoTuner keys as
JSON. The loop is written as a user writes it (no runtime.workload helpers): zero_grad, forward and backward
per microbatch (loss / n), optimizer step. Rank 0 writes {"without": [[loss hex per step] per rank], "with": ...,
"phases": [phase per step], "confirmation": [...] or null, "steps_tuning": n, "final_phase": phase}.
"""

import json
import logging
import sys

import torch.distributed as dist

from runtime import AutoTuner
from runtime.rank import init_rank, shutdown_rank
from runtime.workload import build_workload

factory, kwargs, steps, microbatches = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
storage, out, keys = sys.argv[5], sys.argv[6], json.loads(sys.argv[7])
logging.basicConfig(level=logging.INFO, format="%(message)s")
mesh = init_rank("gloo")


def loop(tuner: AutoTuner | None, workload) -> tuple[list[str], list[str]]:
    model, optimizer = workload.model, workload.optimizer
    losses, phases = [], []
    for step in range(steps):
        phases.append(str(tuner.phase) if tuner else "none")
        ctx = tuner.step() if tuner else _null()
        with ctx:
            optimizer.zero_grad()
            total = 0.0
            for i in range(microbatches):
                loss = workload.loss_fn(model, workload.make_batch(step * microbatches + i)) / microbatches
                loss.backward()
                total += loss.detach().double().item()
            optimizer.step()
        losses.append(float(total).hex())
    return losses, phases


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


result = {}
without, _ = loop(None, build_workload(factory, mesh, kwargs))
workload = build_workload(factory, mesh, kwargs)
tuner = AutoTuner(workload.model, study="in-loop", storage=None if storage == "none" else storage, **keys)
with_tuner, phases = loop(tuner, workload)
for name, local in (("without", without), ("with", with_tuner)):
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    result[name] = gathered
c = tuner.confirmation
result.update(phases=phases, steps_tuning=tuner.steps_tuning, final_phase=str(tuner.phase),
              confirmation=None if c is None else [c.ratio, list(c.ci95), c.rounds, str(c.verdict)])
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump(result, f)
shutdown_rank()
