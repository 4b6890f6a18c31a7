"""Hugging Face ``Trainer`` on a model transformers shards with FSDP2, tuned by the ``PrefetchTuningCallback``.

    pip install 'prefetch-planner[hf]'
    torchrun --nproc-per-node 8 docs/examples/hf_trainer.py
    torchrun --nproc-per-node 2 docs/examples/hf_trainer.py --small --quick  # a minute: a small Llama, quick tuning
    torchrun --nproc-per-node 2 docs/examples/hf_trainer.py --cpu --quick    # no GPU: gloo, the small Llama

A Llama from a config (random weights, no download) is saved to a temporary folder, then loaded on every rank with
``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=WORLD))``: transformers applies
``fully_shard`` to each decoder layer and the root, on GPUs (NCCL) and on CPU (gloo) alike, and the Trainer trains
that model as it is. The callback builds the tuner on the sharded model at the first step and makes each
optimizer step, all its gradient-accumulation microbatches, one ``tuner.step()``.

Accelerate's own FSDP plugin (``TrainingArguments(fsdp=True, fsdp_config={"fsdp_version": 2})``) works with the
callback too, on GPUs; on CPU Accelerate trains the model under DDP instead, and the callback stops with an error
that says so.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.distributed import DistributedConfig

from runtime.adapters.hf import PrefetchTuningCallback

# The tuner's stages shortened (--quick): what the plain-loop example's --quick uses.
QUICK = {"sim_trials": 40, "measured_trials": 2, "min_rounds": 2, "max_rounds": 4, "confirm_min_rounds": 6,
         "confirm_max_rounds": 6, "warmup_steps": 1, "steps": 2, "profile_repeats": 1}
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=256, max_position_embeddings=64)
LARGE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=12, num_attention_heads=16,
             vocab_size=32000)


class RandomTokens(torch.utils.data.Dataset):
    """``size`` sequences of ``length`` seeded random tokens below ``vocab``, each its own labels."""

    def __init__(self, vocab: int, length: int, size: int = 100_000):
        self.vocab, self.length, self.size = vocab, length, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, self.vocab, (self.length,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": tokens, "labels": tokens}


def sharded_llama(shape: dict, cpu: bool, folder: str) -> LlamaForCausalLM:
    """A Llama of ``shape`` (seed 0) saved to ``folder`` by rank 0, then loaded on every rank FSDP2-sharded over
    the world by transformers (``DistributedConfig``)."""
    if not dist.is_initialized():
        # each rank on its own GPU before NCCL starts (the barrier below would otherwise put every rank on cuda:0)
        device = None if cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if device is not None:
            torch.cuda.set_device(device)
        dist.init_process_group("gloo" if cpu else "nccl", device_id=device)
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(folder, "config.json")):
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(folder)
    dist.barrier()
    sharding = DistributedConfig(fsdp_size=dist.get_world_size())
    return LlamaForCausalLM.from_pretrained(folder, distributed_config=sharding)


def training_arguments(cpu: bool, max_steps: int, output_dir: str) -> TrainingArguments:
    """The Trainer's arguments: 2 microbatches of 2 sequences a step, seeded data order, no saving or logs."""
    return TrainingArguments(output_dir=output_dir, max_steps=max_steps, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, use_cpu=cpu, ddp_backend="gloo" if cpu else None,
                             bf16=not cpu, save_strategy="no", logging_strategy="no", report_to=[], seed=0,
                             data_seed=0, dataloader_num_workers=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="CPU ranks with gloo (implies --small)")
    parser.add_argument("--small", action="store_true", help="a 4-layer Llama of width 64, 60 steps")
    parser.add_argument("--quick", action="store_true", help="the tuner's stages shortened")
    parser.add_argument("--max-steps", type=int, default=None, help="training steps (60 with --small, else 500)")
    parser.add_argument("--storage", default="sqlite:///tuning.db", help="the study's database (SQLAlchemy URL)")
    options = parser.parse_args()
    small = options.small or options.cpu
    shape = SMALL if small else LARGE
    size = f"{shape['hidden_size']}x{shape['num_hidden_layers']}"
    model = sharded_llama(shape, options.cpu, os.path.join(tempfile.gettempdir(), f"hf-example-llama-{size}"))
    args = training_arguments(options.cpu, options.max_steps or (60 if small else 500),
                              os.path.join(tempfile.gettempdir(), "hf-example"))
    callback = PrefetchTuningCallback(study="hf-example", storage=options.storage, **(QUICK if options.quick else {}))
    data = RandomTokens(shape["vocab_size"], 32 if small else 512)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    print(f"rank {dist.get_rank()}: phase {callback.tuner.phase}", flush=True)
    dist.destroy_process_group()  # the process group started above, ended before the interpreter tears down


if __name__ == "__main__":
    main()
