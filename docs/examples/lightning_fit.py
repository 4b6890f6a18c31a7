"""Lightning's ``fit`` with FSDP2 (``ModelParallelStrategy``, ``fully_shard`` in ``configure_model``), tuned by the
``PrefetchTuning`` callback.

    pip install 'prefetch-planner[lightning]'
    python docs/examples/lightning_fit.py                    # 2 CPU processes (gloo), Lightning launches them
    python docs/examples/lightning_fit.py --accelerator gpu --devices 8 --max-steps 500

``--quick`` shortens every stage of the tuning (a demo, not a verdict to trust).
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard

from runtime.adapters.lightning import PrefetchTuning

QUICK = {"sim_trials": 40, "measured_trials": 2, "min_rounds": 2, "max_rounds": 4, "confirm_min_rounds": 6,
         "confirm_max_rounds": 6, "warmup_steps": 1, "steps": 2, "profile_repeats": 1}


class Blocks(nn.Module):
    """A stack of residual MLP blocks."""

    def __init__(self, dim: int = 64, layers: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(),
                                                  nn.Linear(4 * dim, dim)) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


class Task(pl.LightningModule):
    """The model, its loss and optimizer; each block is one FSDP module, then the model's root."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = Blocks()

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        return self.model(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3)


class Noise(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randn(64, generator=torch.Generator().manual_seed(i))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--storage", default="sqlite:///tuning.db")
    parser.add_argument("--quick", action="store_true", help="shorten every stage of the tuning")
    args = parser.parse_args()

    tuning = PrefetchTuning(study="lightning-example", storage=args.storage, **(QUICK if args.quick else {}))
    trainer = pl.Trainer(strategy=ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1),
                         accelerator=args.accelerator, devices=args.devices, max_steps=args.max_steps,
                         accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, callbacks=[tuning])
    trainer.fit(Task(), torch.utils.data.DataLoader(Noise(), batch_size=4))
    if trainer.global_rank == 0:
        print(f"phase {tuning.tuner.phase}; steps spent tuning {tuning.tuner.steps_tuning}")


if __name__ == "__main__":
    main()
