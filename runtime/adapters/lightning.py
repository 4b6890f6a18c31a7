"""``runtime.AutoTuner`` in Lightning (``ModelParallelStrategy``, ``fully_shard`` in ``configure_model``).

::

    from runtime.adapters.lightning import PrefetchTuning

    trainer = L.Trainer(strategy=ModelParallelStrategy(), callbacks=[PrefetchTuning(study="my-job")])

The tuner is built at ``on_train_start`` on the outermost module that ``configure_model`` wrapped with
``fully_shard`` (or on ``module_of(pl_module)`` when given). One optimizer step, all its
``accumulate_grad_batches`` batches, is one ``tuner.step()``: entered at the step's first batch
(``on_train_batch_start``), left after its last (``on_train_batch_end``, after the optimizer step).

A callback alone never sees the error of a step it could skip: Lightning calls ``on_exception`` only once the fit is
over. So at ``on_train_start`` the callback wraps the module's ``training_step`` and ``backward``: an error in either
goes to the tuner, which skips a candidate's out-of-memory step (``on_oom="skip"``: the trial FAIL, the gradients
cleared, the plan kept applied); that batch and the step's others then return a zero loss from ``training_step``
without running, and their ``backward`` does nothing, so the optimizer step finds no gradient. (Lightning refuses
the ``None`` it skips a batch on in distributed training.) Every rank skips together: the tuner's ranks agree first.
The wrappers go at ``on_train_end``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError as e:  # the framework is an extra, not a core dependency
    raise ImportError("runtime.adapters.lightning needs lightning: pip install 'prefetch-planner[lightning]'") from e
import torch
from torch import nn

from runtime.adapters import HeldStep, root_fsdp_module
from runtime.in_loop.autotuner import AutoTuner


class PrefetchTuning(Callback):
    """A Lightning ``Callback`` that tunes FSDP2's prefetch on the Trainer's own steps.

    Args:
        study: the study's name, as :class:`runtime.AutoTuner`'s.
        storage: the study's SQLAlchemy URL (``None``: ``sqlite:///studies/NAME.db``), as :class:`runtime.AutoTuner`'s.
        memory_budget: the per-rank peak a plan may reach (``"+20%"``, ``"1.5GiB"``), as
            :class:`runtime.AutoTuner`'s.
        **keys: :class:`runtime.AutoTuner`'s other keywords (``plan_out=``, ``recheck=``, any study key).
        module_of: the root FSDP module of the ``LightningModule`` (default: its outermost ``fully_shard`` module).
        enable: build the tuner (``False``: the callback does nothing, the Trainer trains as it would without it).

    Attributes:
        tuner: the :class:`runtime.AutoTuner` once training started (``None`` before, and with ``enable=False``).
    """

    def __init__(self, study: str, storage: str | None = None, memory_budget: str | None = None,
                 module_of: Callable[[Any], nn.Module] = root_fsdp_module, enable: bool = True, **keys: Any):
        self.study, self.storage, self.memory_budget, self.keys = study, storage, memory_budget, keys
        self.module_of = module_of
        self.enable = enable
        self.tuner: AutoTuner | None = None
        self._held = HeldStep()
        self._wrapped: Any = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.enable:
            self.tuner = AutoTuner(self.module_of(pl_module), self.study, self.storage, self.memory_budget,
                                   **self.keys)
            self._wrap(pl_module)

    def _wrap(self, pl_module: Any) -> None:
        """``pl_module.training_step`` and ``backward`` with the tuner's skip (the module docstring says why)."""
        training_step, backward = pl_module.training_step, pl_module.backward

        def tuned_training_step(*args: Any, **kwargs: Any) -> Any:
            if self.skipping:
                return torch.zeros((), device=pl_module.device)
            try:
                return training_step(*args, **kwargs)
            except Exception as e:
                if not self.skip(e):
                    raise
                return torch.zeros((), device=pl_module.device)

        def tuned_backward(loss: Any, *args: Any, **kwargs: Any) -> None:
            if self.skipping:
                return
            try:
                backward(loss, *args, **kwargs)
            except Exception as e:
                if not self.skip(e):
                    raise

        pl_module.training_step, pl_module.backward = tuned_training_step, tuned_backward
        self._wrapped = pl_module

    @property
    def skipping(self) -> bool:
        """The tuner skipped this optimizer step (:meth:`skip`): its batches return a zero loss and run no
        backward."""
        return self._held.skipping

    def skip(self, error: BaseException) -> bool:
        """A batch of this optimizer step raised ``error``: ``True`` if the tuner skipped the step
        (``runtime.adapters.HeldStep.skip``), ``False`` if the error is the caller's to raise."""
        return self._held.skip(error)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.tuner is not None and batch_idx % trainer.accumulate_grad_batches == 0:
            self._held.enter(self.tuner)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self._held.leave()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        with contextlib.suppress(Exception):  # Lightning re-raises ``exception``; the tuner records its trial FAIL
            self._held.skip(exception)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._wrapped is not None:  # the module's own methods again
            del self._wrapped.training_step, self._wrapped.backward
            self._wrapped = None
        if self.tuner is not None:
            self.tuner.close()
