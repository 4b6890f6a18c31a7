"""torchtitan with in-loop prefetch tuning: its ``Trainer`` subclassed, each ``train_step`` one ``tuner.step()``.

    pip install torchtitan prefetch-planner
    torchrun --nproc-per-node 8 docs/examples/torchtitan_recipe.py --job.config_file llama3_8b.toml

torchtitan has no callbacks, so the recipe subclasses its trainer. After ``parallelize`` and the optimizer are
built, ``model_parts[0]`` is the FSDP2 root. Every rank builds the tuner on the same step and enters
``tuner.step()`` on the same steps, as ``AutoTuner`` requires. To apply a saved plan instead, call
``apply_plan(model_parts[0], load_best_plan(url, study, model_parts[0]))`` where the model parts are ready (for example
in a ``ModelConverter.post_optimizer_hook``).

Not run in this project's CI (torchtitan is not one of its dependencies, and its models want GPUs).
"""

from __future__ import annotations

import os

import torchtitan.train
from torchtitan.config import ConfigManager

from runtime import AutoTuner


class TunedTrainer(torchtitan.train.Trainer):
    """torchtitan's ``Trainer``, its steps wrapped by the prefetch tuner."""

    def train_step(self, data_iterator):
        if not hasattr(self, "tuner"):  # after parallelize and the optimizer: model_parts[0] is the FSDP root
            self.tuner = AutoTuner(self.model_parts[0], study="torchtitan",
                                   storage=os.environ.get("PREFETCH_STUDIES", "sqlite:///tuning.db"))
        with self.tuner.step():
            return super().train_step(data_iterator)


def main() -> None:
    config = ConfigManager().parse_args()
    trainer = TunedTrainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()


if __name__ == "__main__":
    main()
