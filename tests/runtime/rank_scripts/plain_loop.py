"""Rank script: a plain PyTorch training loop on a stock torch model, not one of ``runtime.reference_workloads``.

argv: storage URL, output JSON, AutoTuner keys JSON, steps.

The model is ``docs/examples/plain_loop.py``'s: a stack of ``torch.nn.TransformerEncoderLayer`` (dropout on) with a
linear head, ``fully_shard`` on each layer and then the root, AdamW, a cross-entropy loss on random tokens: written
the way a user writes it, with nothing from ``runtime`` but the tuner. The loop runs three times, each on a freshly
built model: without the tuner, with it (a cold study), and with it again on the same study (the next start). Rank 0
writes {"without", "with", "again": [loss hex per step], "phases"/"phases_again": [phase per step],
"steps_tuning"/"steps_tuning_again", "confirmation"/"confirmation_again": [ratio, verdict, launches] or null,
"log": the tuner's log lines}. ``TEST_MESH`` (``[replicate, shard]`` as JSON): shard as HSDP on that mesh.
"""

import importlib.util
import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from runtime import AutoTuner
from tests.multirank import end_rank

storage, out, keys, steps = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("gloo")
torch.set_num_threads(1)
hsdp = json.loads(os.environ.get("TEST_MESH", "null"))
mesh = init_device_mesh("cpu", tuple(hsdp), mesh_dim_names=("replicate", "shard")) if hsdp else None
lines: list[str] = []


class Remember(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        lines.append(record.getMessage())


logging.getLogger("runtime.in_loop.autotuner").addHandler(Remember())
logging.getLogger("runtime.in_loop.autotuner").setLevel(logging.INFO)


def _example_classifier() -> type[nn.Module]:
    """The model of ``docs/examples/plain_loop.py``, the loop a user copies (its ``main`` does not run on import)."""
    path = Path(__file__).resolve().parents[3] / "docs" / "examples" / "plain_loop.py"
    spec = importlib.util.spec_from_file_location("plain_loop_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Classifier


Classifier = _example_classifier()


def build():
    torch.manual_seed(0)
    model = Classifier()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(tuner_study: bool):
    model, optimizer = build()
    tuner = AutoTuner(model, study="plain", storage=storage, **keys) if tuner_study else None
    data = torch.Generator().manual_seed(1 + dist.get_rank())
    losses, phases = [], []
    for _ in range(steps):
        tokens = torch.randint(0, 128, (4, 16), generator=data)
        phases.append(str(tuner.phase) if tuner else "none")
        with tuner.step() if tuner else torch.enable_grad():
            loss = nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item().hex())
    return losses, phases, tuner


result = {"without": train(False)[0]}
result["with"], result["phases"], tuner = train(True)
c = tuner.confirmation
result["steps_tuning"] = tuner.steps_tuning
result["confirmation"] = None if c is None else [c.ratio, str(c.verdict), c.launches]
result["again"], result["phases_again"], again = train(True)
result["steps_tuning_again"] = again.steps_tuning
c = again.confirmation
result["confirmation_again"] = None if c is None else [c.ratio, str(c.verdict), c.launches]
result["log"] = lines
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump(result, f)
end_rank()
