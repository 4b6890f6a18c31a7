"""Rank script: the trainer adapters driven by a loop of our own, with the frameworks' real classes.

argv: output JSON, AutoTuner keys JSON. The same 2-microbatch loop runs three times on fresh MLPs: bare; through
``runtime.adapters.hf.PrefetchTuningCallback`` (a real ``TrainerState`` and ``TrainerControl``, the hooks called
where ``transformers.Trainer`` calls them); through ``runtime.adapters.lightning.PrefetchTuning`` (a real
``lightning.pytorch.Trainer`` with ``accumulate_grad_batches=2`` and a ``LightningModule``, the batch hooks
called where Lightning calls them). Rank 0 writes {"bare"/"hf"/"lightning": [[loss hex per step] per rank],
"phases": {"hf": final phase, "lightning": final phase}}.
"""

import json
import os
import sys

import lightning.pytorch as pl
import torch.distributed as dist
from transformers import TrainerControl, TrainerState

from runtime.adapters.hf import PrefetchTuningCallback
from runtime.adapters.lightning import PrefetchTuning
from runtime.ranks.rank import init_rank, shutdown_rank
from runtime.workload import build_workload

out, keys = sys.argv[1], json.loads(sys.argv[2])
os.chdir(os.path.dirname(os.path.abspath(out)))  # the tuners' default storage, studies/NAME.db, in the test's folder
STEPS, N = 40, 2
mesh = init_rank("gloo")


def fresh():
    return build_workload("runtime.reference_workloads:mlp", mesh, {"dim": 64, "layers": 4, "dropout": 0.1})


def microbatch(w, step, i):
    loss = w.loss_fn(w.model, w.make_batch(step * N + i)) / N
    loss.backward()
    return loss.detach().double().item()


def bare():
    w, losses = fresh(), []
    for step in range(STEPS):
        w.optimizer.zero_grad()
        total = sum(microbatch(w, step, i) for i in range(N))
        w.optimizer.step()
        losses.append(float(total).hex())
    return losses


def hf():
    w, losses = fresh(), []
    cb, state, control = PrefetchTuningCallback(study="hf", **keys), TrainerState(), TrainerControl()
    cb.on_train_begin(None, state, control, model=w.model)
    for step in range(STEPS):
        total = 0.0
        for i in range(N):
            if i == 0:
                cb.on_step_begin(None, state, control, model=w.model)
            total += microbatch(w, step, i)
        w.optimizer.step()
        w.model.zero_grad()
        cb.on_step_end(None, state, control)
        losses.append(float(total).hex())
    cb.on_train_end(None, state, control)
    return losses, str(cb.tuner.phase)


class Module(pl.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model


def lightning():
    w, losses = fresh(), []
    trainer = pl.Trainer(accelerator="cpu", devices=1, accumulate_grad_batches=N, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module, cb = Module(w.model), PrefetchTuning(study="lightning", **keys)
    cb.on_train_start(trainer, module)
    for step in range(STEPS):
        total = 0.0
        for i in range(N):
            index = step * N + i
            cb.on_train_batch_start(trainer, module, None, index)
            total += microbatch(w, step, i)
            if i == N - 1:
                w.optimizer.step()
                w.optimizer.zero_grad()
            cb.on_train_batch_end(trainer, module, None, None, index)
        losses.append(float(total).hex())
    cb.on_train_end(trainer, module)
    return losses, str(cb.tuner.phase)


result = {"bare": bare()}
result["hf"], hf_phase = hf()
result["lightning"], pl_phase = lightning()
gathered = {}
for name, local in result.items():
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    gathered[name] = everyone
gathered["phases"] = {"hf": hf_phase, "lightning": pl_phase}
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump(gathered, f)
shutdown_rank()
