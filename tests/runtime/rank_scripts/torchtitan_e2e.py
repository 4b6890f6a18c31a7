"""Rank script: torchtitan 0.3's own Trainer end to end on 2 gloo ranks (its llama3 debug model at CPU size,
``docs/examples/torchtitan_recipe.py``'s shims and assets), without or with the prefetch tuner
(``runtime.adapters.torchtitan.TunedTrainer``).

argv: "bare" or "tune", output folder, steps. ``TEST_TENSOR_PARALLEL`` (a TP degree): torchtitan's
``tensor_parallel_degree``, FSDP over the other ranks. Each rank writes <mode>-<rank>.json: {"losses": [hex per
microbatch], "phase": the tuner's final phase or null, "steps_tuning": the steps it spent or null}; rank 0 of the
tuned run writes the profile it recorded to tune.profile.json.
"""

import importlib.util
import json
import os
import sys

import torch

from tests.multirank import ROOT, end_rank

spec = importlib.util.spec_from_file_location("torchtitan_recipe", ROOT / "docs" / "examples" / "torchtitan_recipe.py")
recipe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(recipe)
recipe.cpu_shims()

from torchtitan.trainer import Trainer  # noqa: E402  (after the shims)

from runtime.adapters.torchtitan import tuned  # noqa: E402

mode, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
losses: list[str] = []
forward_backward_step = Trainer.forward_backward_step


def recorded(self, *args, **kwargs):
    loss = forward_backward_step(self, *args, **kwargs)
    losses.append(loss.detach().double().item().hex())
    return loss


Trainer.forward_backward_step = recorded
assets = os.path.join(out, f"assets-{os.environ['RANK']}")
recipe.write_debug_assets(assets)
config = recipe.debug_config(assets, steps, tensor_parallel=int(os.environ.get("TEST_TENSOR_PARALLEL", "1")))
if mode == "tune":
    config = tuned(config, study="torchtitan-e2e", storage=f"sqlite:///{out}/tuning.db",
                   keys={**recipe.QUICK, "profile_out": f"{out}/tune.profile.json"})
trainer = config.build()
recipe.force_sum_reduction(trainer)
trainer.train()
trainer.close()
tuner = getattr(trainer, "tuner", None)
with open(f"{out}/{mode}-{torch.distributed.get_rank()}.json", "w") as f:
    json.dump({"losses": losses, "phase": str(tuner.phase) if tuner else None,
               "steps_tuning": tuner.steps_tuning if tuner else None}, f)
end_rank()
