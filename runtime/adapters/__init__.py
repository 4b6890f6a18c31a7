"""The in-loop tuner in the trainers people use: each adapter is a few lines over ``runtime.AutoTuner``.

- :mod:`runtime.adapters.hf`: a ``transformers.TrainerCallback`` (extra ``prefetch-planner[hf]``).
- :mod:`runtime.adapters.lightning`: a ``lightning.pytorch.Callback`` (extra ``prefetch-planner[lightning]``).
- :mod:`runtime.adapters.torchtitan`: torchtitan's ``Trainer`` subclassed (extra ``prefetch-planner[torchtitan]``).
"""

from __future__ import annotations

from typing import Any

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


class HeldStep:
    """One ``tuner.step()`` held open across a trainer's hooks: entered at an optimizer step's first microbatch, left
    after the optimizer step; and the skip that the trainer's own step asks of it when a microbatch raised.

    Attributes:
        skipping: the tuner skipped this optimizer step (:meth:`skip`): the step's other microbatches run nothing,
            until the next :meth:`enter`.
    """

    def __init__(self) -> None:
        self.skipping = False
        self._step: Any = None

    def enter(self, tuner: Any) -> None:
        """Enter ``tuner.step()`` (``runtime.AutoTuner``) for the optimizer step that starts."""
        self.skipping = False
        self._step = tuner.step()
        self._step.__enter__()

    def leave(self) -> None:
        """Leave the step entered, if one is (after the optimizer step)."""
        step, self._step = self._step, None
        if step is not None:
            step.__exit__(None, None, None)

    def skip(self, error: BaseException) -> bool:
        """A microbatch of this optimizer step raised ``error``: the tuner's step is left with it. ``True``: the
        tuner skipped the step (an out-of-memory error in a candidate's step on every rank: the trial FAIL, the
        gradients cleared, the plan kept applied) and :attr:`skipping` holds; ``False``: the error is the caller's
        to raise.

        Raises:
            TrialFailedError: a peer's step raised too and the ranks cannot go on together.
        """
        step, self._step = self._step, None
        if step is None or not step.__exit__(type(error), error, error.__traceback__):
            return False
        self.skipping = True
        return True
