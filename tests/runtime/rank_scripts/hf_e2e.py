"""Rank script: Hugging Face ``Trainer.train()`` end to end on 2 gloo ranks, on a small Llama that transformers
shards with FSDP2 (``DistributedConfig``; ``docs/examples/hf_trainer.py``'s model, data and arguments), without or
with ``runtime.adapters.hf.PrefetchTuningCallback``.

argv: "bare", "tune", "oom" or "skip:K", output folder, optimizer steps. ``oom``: as ``tune`` under
``runtime.adapters.hf.TunedTrainer``, and the first microbatch that runs a candidate raises ``torch.OutOfMemoryError``
on every rank before the first decoder layer's forward (the tuner must skip that optimizer step and go on);
``skip:K``: as ``bare``, every microbatch of optimizer step K skipped (a zero loss, nothing run). Each rank writes
<mode>-<rank>.json: {"losses": [hex per microbatch], "phase": the tuner's final phase or null, "steps_tuning": the
steps it spent or null, "skipped": the optimizer step the tuner skipped or null, "failed": the study's FAIL
reasons (oom)}.
"""

import importlib.util
import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import Trainer

from runtime.adapters.hf import PrefetchTuningCallback, TunedTrainer
from tests.multirank import ROOT, end_rank

spec = importlib.util.spec_from_file_location("hf_trainer", ROOT / "docs" / "examples" / "hf_trainer.py")
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)

mode, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
skip = int(mode.split(":")[1]) if mode.startswith("skip:") else None
losses: list[str] = []


class Recorded(TunedTrainer if mode == "oom" else Trainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        if skip is not None and self.state.global_step == skip:
            return torch.zeros((), device=self.args.device)
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        loss = super().compute_loss(model, inputs, return_outputs, **kwargs)
        losses.append(loss.detach().double().item().hex())
        return loss


model = example.sharded_llama(example.SMALL, cpu=True, folder=os.path.join(out, "llama"))
args = example.training_arguments(True, steps, os.path.join(out, f"trainer-{mode}-{dist.get_rank()}"))
storage = f"sqlite:///{out}/tuning-{mode}.db"
callbacks = [PrefetchTuningCallback(study="hf-e2e", storage=storage, **example.QUICK)] \
    if mode in ("tune", "oom") else []
trainer = Recorded(model=model, args=args, train_dataset=example.RandomTokens(example.SMALL["vocab_size"], 32),
                   callbacks=callbacks)
fired = []


def out_of_memory_at_a_candidate(module, args):
    tuner = callbacks[0].tuner
    if fired or tuner is None or str(tuner.phase) != "racing" or tuner._steps.applied in (0, None):
        return
    fired.append(trainer.state.global_step)
    raise torch.OutOfMemoryError("CUDA out of memory (injected on every rank)")


if mode == "oom":
    model.model.layers[0].register_forward_pre_hook(out_of_memory_at_a_candidate)
trainer.train()
tuner = callbacks[0].tuner if callbacks else None
failed = []
if mode == "oom" and dist.get_rank() == 0:
    import optuna

    trials = optuna.load_study(study_name="hf-e2e", storage=storage).trials
    failed = [t.user_attrs.get("fail_reason", "") for t in trials if t.state.name == "FAIL"]
with open(f"{out}/{mode}-{dist.get_rank()}.json", "w") as f:
    json.dump({"losses": losses, "phase": str(tuner.phase) if tuner else None,
               "steps_tuning": tuner.steps_tuning if tuner else None, "skipped": fired[0] if fired else None,
               "failed": failed}, f)
end_rank()
