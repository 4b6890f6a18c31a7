"""The in-loop tuner in the trainers people use: each adapter is a few lines over ``runtime.AutoTuner``.

- :mod:`runtime.adapters.hf`: a ``transformers.TrainerCallback`` (extra ``prefetch-planner[hf]``).
- :mod:`runtime.adapters.lightning`: a ``lightning.pytorch.Callback`` (extra ``prefetch-planner[lightning]``).
- :mod:`runtime.adapters.torchtitan`: torchtitan's ``Trainer`` subclassed (extra ``prefetch-planner[torchtitan]``).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule

from planner.errors import NotShardedError


def root_fsdp_module(module: nn.Module) -> nn.Module:
    """``module`` if it is wrapped with ``fully_shard``, else its outermost FSDP submodule (the first one in
    ``named_modules`` order, which visits parents before children).

    Raises:
        NotShardedError: nothing in ``module`` is wrapped with ``fully_shard``.
    """
    for _, m in module.named_modules():
        if isinstance(m, FSDPModule):
            return m
    raise NotShardedError(f"{type(module).__name__} holds no module wrapped with fully_shard; shard the model "
                          "(FSDP2) before training starts")
