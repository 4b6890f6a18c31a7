"""Hugging Face ``Trainer`` with Accelerate's FSDP2, tuned by the ``PrefetchTuningCallback``. GPUs only: on CPU the
Trainer falls back to DDP (``is_fsdp_enabled`` is false), so there is nothing to tune.

    pip install 'prefetch-planner[hf]'
    accelerate launch --num_processes 8 docs/examples/hf_trainer.py
    accelerate launch --num_processes 2 docs/examples/hf_trainer.py --small   # a minute: a small model, quick tuning

A small Llama from a config (random weights, no download) on random tokens. Accelerate applies ``fully_shard`` to
each decoder layer and the root (``fsdp_version: 2``); the callback builds the tuner on the sharded model at the first
step and makes each optimizer step, all its gradient-accumulation microbatches, one ``tuner.step()``.
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from runtime.adapters.hf import PrefetchTuningCallback


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int, length: int = 512, size: int = 100_000):
        self.vocab, self.length, self.size = vocab, length, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, self.vocab, (self.length,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": tokens, "labels": tokens}


# The tuner's stages shortened (--small): what the plain-loop example's --quick uses.
QUICK = {"sim_trials": 40, "measured_trials": 2, "min_rounds": 2, "max_rounds": 4, "confirm_min_rounds": 6,
         "confirm_max_rounds": 6, "warmup_steps": 1, "steps": 2, "profile_repeats": 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a small Llama, 60 steps, quick tuning")
    parser.add_argument("--storage", default="sqlite:///tuning.db", help="the study's database (SQLAlchemy URL)")
    options = parser.parse_args()
    small = options.small
    shape = (dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4, vocab_size=2048)
             if small else dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=12,
                                num_attention_heads=16, vocab_size=32000))
    config = LlamaConfig(**shape)
    model = LlamaForCausalLM(config)
    args = TrainingArguments(
        output_dir="/tmp/hf-example", max_steps=60 if small else 500, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, bf16=True, logging_steps=50, report_to=[], save_strategy="no",
        fsdp="full_shard", fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                        "reshard_after_forward": True},
    )
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(config.vocab_size),
                      callbacks=[PrefetchTuningCallback(study="hf-example", storage=options.storage,
                                                         **(QUICK if small else {}))])
    trainer.train()


if __name__ == "__main__":
    main()
