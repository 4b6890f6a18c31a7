"""Activation checkpointing of the blocks ``fully_shard`` wraps, with torchtitan's meaning of the modes.

torchtitan (``torchtitan/models/llama3/infra/parallelize.py``, ``apply_ac``) wraps each transformer block with
``checkpoint_wrapper`` before ``fully_shard`` wraps it: ``"full"`` checkpoints every block; its layer-selective
mode with ``selective_ac_option = "2"`` checkpoints every other block (the 2nd, 4th, ...: it counts blocks from
1 and wraps those whose count is a multiple of 2). Here ``"selective"`` means that. The checkpoint sits inside
the FSDP module, so FSDP2's hooks run once around the block and backward recomputes the block's forward after
its pre-backward all-gather, with the parameters unsharded (``torch.utils.checkpoint``, non-reentrant).

The block's ``forward`` is replaced on the instance rather than the block wrapped in another module, so module
and parameter names stay those of the plain model. ``preserve_rng_state`` stays on: a block with dropout
recomputes the same mask, and the loss is bitwise that of the model without checkpointing.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from torch import nn
from torch.utils.checkpoint import checkpoint

from planner.errors import WorkloadError

MODES = ("none", "full", "selective")


def checkpointed_indices(blocks: int, mode: str) -> list[int]:
    """The indices (0-based) of the blocks ``mode`` checkpoints among ``blocks`` blocks.

    Raises:
        WorkloadError: ``mode`` is not one of :data:`MODES`.
    """
    if mode not in MODES:
        raise WorkloadError(f"activation_checkpointing = {mode!r} is not one of {', '.join(map(repr, MODES))}; "
                            "'full' checkpoints every block, 'selective' every other block (torchtitan's meaning)")
    if mode == "none":
        return []
    return list(range(blocks)) if mode == "full" else [i for i in range(blocks) if (i + 1) % 2 == 0]


def apply_activation_checkpointing(blocks: Sequence[nn.Module], mode: str) -> list[int]:
    """Checkpoint the blocks ``mode`` names (call before ``fully_shard`` wraps them). Returns their indices.

    Raises:
        WorkloadError: an unknown ``mode``.
    """
    chosen = checkpointed_indices(len(blocks), mode)
    for i in chosen:
        block = blocks[i]
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return chosen
