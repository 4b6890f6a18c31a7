"""Rank script: Hugging Face ``Trainer.train()`` end to end on 2 gloo ranks, on a small Llama that transformers
shards with FSDP2 (``DistributedConfig``; ``docs/examples/hf_trainer.py``'s model, data and arguments), without or
with ``runtime.adapters.hf.PrefetchTuningCallback``.

argv: "bare" or "tune", output folder, optimizer steps. Each rank writes <mode>-<rank>.json: {"losses": [hex per
microbatch], "phase": the tuner's final phase or null, "steps_tuning": the steps it spent or null}.
"""

import importlib.util
import json
import os
import sys

import torch.distributed as dist
from transformers import Trainer

from runtime.adapters.hf import PrefetchTuningCallback
from tests.multirank import ROOT

spec = importlib.util.spec_from_file_location("hf_trainer", ROOT / "docs" / "examples" / "hf_trainer.py")
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)

mode, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
losses: list[str] = []


class Recorded(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        loss = super().compute_loss(model, inputs, return_outputs, **kwargs)
        losses.append(loss.detach().double().item().hex())
        return loss


model = example.sharded_llama(example.SMALL, cpu=True, folder=os.path.join(out, "llama"))
args = example.training_arguments(True, steps, os.path.join(out, f"trainer-{mode}-{dist.get_rank()}"))
callbacks = [PrefetchTuningCallback(study="hf-e2e", storage=f"sqlite:///{out}/tuning.db", **example.QUICK)] \
    if mode == "tune" else []
Recorded(model=model, args=args, train_dataset=example.RandomTokens(example.SMALL["vocab_size"], 32),
         callbacks=callbacks).train()
tuner = callbacks[0].tuner if callbacks else None
with open(f"{out}/{mode}-{dist.get_rank()}.json", "w") as f:
    json.dump({"losses": losses, "phase": str(tuner.phase) if tuner else None,
               "steps_tuning": tuner.steps_tuning if tuner else None}, f)
