"""Rank script: Lightning end to end on 2 gloo ranks (ModelParallelStrategy, fully_shard in configure_model),
40 optimizer steps of 2 accumulated batches, without or with runtime.adapters.lightning.PrefetchTuning.

argv: "bare", "tune", "oom" or "skip:K", output folder. ``oom``: as ``tune``, and the first batch that runs a
candidate raises ``torch.OutOfMemoryError`` on every rank before ``blocks.0``'s forward (the adapter's tuner must
skip that optimizer step and go on); ``skip:K``: as ``bare``, every batch of optimizer step K skipped (a zero loss
from ``training_step``, its backward a no-op). Each rank writes <mode>-<rank>.json: {"losses": [hex per batch],
"phase": the tuner's final phase or null, "skipped": the optimizer step the tuner skipped or null, "failed": the
study's FAIL reasons (oom)}.
"""

import json
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

from runtime.adapters.lightning import PrefetchTuning
from runtime.reference_workloads import MLPStack
from tests.multirank import end_rank

KEYS = {"sim_trials": 40, "measured_trials": 2, "min_rounds": 2, "max_rounds": 4, "confirm_min_rounds": 6,
        "confirm_max_rounds": 6, "warmup_steps": 1, "steps": 2, "profile_repeats": 1}
mode, out = sys.argv[1], sys.argv[2]
tune = mode in ("tune", "oom")
skip = int(mode.split(":")[1]) if mode.startswith("skip:") else None

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
        if skip is not None and self.trainer.global_step == skip:
            return torch.zeros(())
        loss = self.model(batch).pow(2).mean()
        self.losses.append(loss.detach().double().item().hex())
        return loss
    def backward(self, loss, *args, **kwargs):
        if skip is not None and self.trainer.global_step == skip:
            return
        super().backward(loss, *args, **kwargs)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3)

class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 80

    def __getitem__(self, i):
        return torch.randn(64, generator=torch.Generator().manual_seed(i))

m = M()
storage = f"sqlite:///{out}/pl-{mode}.db"
cbs = [PrefetchTuning(study="pl-e2e", storage=storage, **KEYS)] if tune else []
fired = []


def out_of_memory_at_a_candidate(module, args):
    tuner = cbs[0].tuner
    if fired or str(tuner.phase) != "racing" or tuner._steps.applied in (0, None):
        return
    fired.append(m.trainer.global_step)
    raise torch.OutOfMemoryError("CUDA out of memory (injected on every rank)")


if mode == "oom":
    m.model.blocks[0].register_forward_pre_hook(out_of_memory_at_a_candidate)
strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2,
                     max_steps=40, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=cbs)
trainer.fit(m, torch.utils.data.DataLoader(Data(), batch_size=4, shuffle=False))
failed = []
if mode == "oom" and trainer.global_rank == 0:
    import optuna

    trials = optuna.load_study(study_name="pl-e2e", storage=storage).trials
    failed = [t.user_attrs.get("fail_reason", "") for t in trials if t.state.name == "FAIL"]
with open(f"{out}/{mode}-{trainer.global_rank}.json", "w") as f:
    json.dump({"losses": m.losses, "phase": str(cbs[0].tuner.phase) if cbs else None,
               "skipped": fired[0] if fired else None, "failed": failed}, f)
end_rank()
