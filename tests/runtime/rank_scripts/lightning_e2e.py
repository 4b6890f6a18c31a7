"""Rank script: Lightning end to end on 2 gloo ranks (ModelParallelStrategy, fully_shard in configure_model),
40 optimizer steps of 2 accumulated batches, without or with runtime.adapters.lightning.PrefetchTuning.

argv: "bare" or "tune", output folder. Each rank writes <mode>-<rank>.json: {"losses": [hex per batch],
"phase": the tuner's final phase or null}.
"""

import json
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

from runtime.adapters.lightning import PrefetchTuning
from runtime.reference_workloads import MLPStack

KEYS = {"sim_trials": 40, "measured_trials": 2, "min_rounds": 2, "max_rounds": 4, "confirm_min_rounds": 6,
        "confirm_max_rounds": 6, "warmup_steps": 1, "steps": 2, "profile_repeats": 1}
tune, out = sys.argv[1] == "tune", sys.argv[2]

class M(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = MLPStack(64, 4)
        self.losses = []
    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for b in self.model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
    def training_step(self, batch, i):
        loss = self.model(batch).pow(2).mean()
        self.losses.append(loss.detach().double().item().hex())
        return loss
    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3)

class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 80

    def __getitem__(self, i):
        return torch.randn(64, generator=torch.Generator().manual_seed(i))

m = M()
cbs = [PrefetchTuning(study="pl-e2e", **KEYS)] if tune else []
strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2,
                     max_steps=40, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=cbs)
trainer.fit(m, torch.utils.data.DataLoader(Data(), batch_size=4, shuffle=False))
with open(f"{out}/{sys.argv[1]}-{trainer.global_rank}.json", "w") as f:
    json.dump({"losses": m.losses, "phase": str(cbs[0].tuner.phase) if cbs else None}, f)
