"""A plain PyTorch training loop with FSDP2, tuned in the loop by ``AutoTuner``.

    torchrun --nproc-per-node 2 docs/examples/plain_loop.py                 # 2 CPU ranks (gloo)
    torchrun --nproc-per-node 8 docs/examples/plain_loop.py --steps 500     # 8 GPUs (nccl)

The model is a stack of ``nn.TransformerEncoderLayer`` blocks with a linear head, ``fully_shard`` on each block and
then the root. The only lines of the tuner are the import, its construction and ``with tuner.step():``. ``--quick``
shortens every stage of the tuning (a demo, not a verdict to trust).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from runtime import AutoTuner

QUICK = {"sim_trials": 40, "measured_trials": 2, "min_rounds": 2, "max_rounds": 4, "confirm_min_rounds": 6,
         "confirm_max_rounds": 6, "warmup_steps": 1, "steps": 2, "profile_repeats": 1}


class Classifier(nn.Module):
    """Token embedding, ``layers`` transformer encoder blocks, a linear head over the vocabulary."""

    def __init__(self, vocab: int = 128, dim: int = 64, layers: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, dropout=0.1, batch_first=True)
            for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--storage", default="sqlite:///tuning.db", help="the study's database (SQLAlchemy URL)")
    parser.add_argument("--study", default="plain-loop")
    parser.add_argument("--quick", action="store_true", help="shorten every stage of the tuning")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    # each rank on its own GPU before NCCL starts: torchrun's LOCAL_RANK, and device_id binds the communicator to it
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    torch.manual_seed(0)
    model = Classifier().to(device)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1 + dist.get_rank())

    # --8<-- [start:loop]
    tuner = AutoTuner(model, study=args.study, storage=args.storage, **(QUICK if args.quick else {}))
    for _ in range(args.steps):
        tokens = torch.randint(0, 128, (4, 16), generator=data).to(device)
        with tuner.step():                                 # one optimizer step, all its microbatches
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    # --8<-- [end:loop]
    if dist.get_rank() == 0:
        c = tuner.confirmation
        print(f"phase {tuner.phase}; steps spent tuning {tuner.steps_tuning}; "
              + (f"{c.verdict}: ratio {c.ratio:.3f} [{c.ci95[0]:.3f}, {c.ci95[1]:.3f}], {c.launches} launch(es)"
                 if c is not None else "nothing confirmed"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
