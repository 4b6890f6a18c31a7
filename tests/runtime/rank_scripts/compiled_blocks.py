"""Rank script: blocks compiled with inductor before ``fully_shard``, as torchtitan orders it, with the AutoTuner.

argv: output folder, AutoTuner keys JSON, steps.

Each MLP block is replaced by ``torch.compile(block, fullgraph=True)`` (its parameters then named
``blocks.N._orig_mod.*``), then ``fully_shard`` on each block and the root. Four models, each built fresh:

1. eager (nothing compiled), the tuner to the end of its tuning, which writes its profile (``eager.profile.json``);
   a plan with a hand-set prefetch list saved from the model (``eager.plan.json``);
2. compiled, the tuner built before the first step, as a user adds it (the blocks compile with its hooks in
   place): the losses, phases and profile (``compiled.profile.json``), and the graphs Dynamo compiled in the loop;
3. compiled, the loop without the tuner: the reference losses, and the graphs Dynamo compiled in it (none new: the
   same code, already compiled);
4. compiled, the plan saved on the eager model applied before the first step.

Rank 0 writes ``result.json``: {"without", "with": [loss hex per step], "phases", "final_phase",
"graphs_with", "graphs_without": graphs Dynamo compiled in loops 2 and 3, "applied": the prefetch lists read back
from model 4 (``current_plan``) or null, "refused": the error's type and message or null}.
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from runtime import AutoTuner, apply_plan, current_plan, load_plan
from runtime.current import fsdp2_default
from runtime.ranks.rank import init_rank, shutdown_rank
from runtime.ranks.torch_private import compiled_graphs
from runtime.reference_workloads import MLPStack

folder, keys, steps = Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
mesh = init_rank("gloo")
rank = dist.get_rank()


def build(compiled: bool):
    torch.manual_seed(0)
    model = MLPStack(dim=64, layers=4)
    for i, block in enumerate(model.blocks):
        if compiled:
            block = torch.compile(block, fullgraph=True)
            model.blocks[i] = block
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def batch(step: int) -> torch.Tensor:
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(10_000 * step + rank))


def step(model, optimizer, i: int) -> str:
    optimizer.zero_grad()
    loss = model(batch(i)).pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss.detach().double().item().hex()


# 1. eager: the profile, and a plan saved on the eager model
model, optimizer = build(compiled=False)
tuner = AutoTuner(model, study="eager", storage=f"sqlite:///{folder}/eager.db",
                  profile_out=str(folder / "eager.profile.json"), **keys)
for i in range(steps):  # to the end of the tuning: the session writes the profile when it finishes
    with tuner.step():
        step(model, optimizer, i)
tuner.close()
plan = fsdp2_default(model)
plan = dataclasses.replace(plan, modules={
    **plan.modules, "blocks.0": dataclasses.replace(plan.modules["blocks.0"], forward_prefetch=("blocks.1",))})
if rank == 0:
    plan.to_json(folder / "eager.plan.json")
del tuner, model, optimizer

# 2. compiled, the tuner from the first step, as a user adds it: the blocks compile with its hooks in place
model, optimizer = build(compiled=True)
tuner = AutoTuner(model, study="compiled", storage=f"sqlite:///{folder}/compiled.db",
                  profile_out=str(folder / "compiled.profile.json"), **keys)
before = compiled_graphs()
losses, phases = [], []
for i in range(steps):
    phases.append(str(tuner.phase))
    with tuner.step():
        losses.append(step(model, optimizer, i))
graphs_with = compiled_graphs() - before
final_phase = str(tuner.phase)
tuner.close()
del tuner, model, optimizer

# 3. compiled, without the tuner: the reference losses, and what the same blocks compile without it
model, optimizer = build(compiled=True)
before = compiled_graphs()
without = [step(model, optimizer, i) for i in range(steps)]
graphs_without = compiled_graphs() - before
del model, optimizer

# 4. compiled, the eager model's plan applied at training start
dist.barrier()
model, optimizer = build(compiled=True)
applied = refused = None
try:
    apply_plan(model, load_plan(folder / "eager.plan.json"))
    applied = {fqn: list(m.forward_prefetch) for fqn, m in current_plan(model).modules.items()}
    step(model, optimizer, 0)
except Exception as e:  # noqa: BLE001 - what a user would see, recorded
    refused = [type(e).__name__, str(e)]

if rank == 0:
    (folder / "result.json").write_text(json.dumps({
        "without": without, "with": losses, "phases": phases, "final_phase": final_phase,
        "graphs_without": graphs_without, "graphs_with": graphs_with, "applied": applied, "refused": refused}))
del model, optimizer
shutdown_rank()
