"""``runtime.AutoTuner`` in Lightning (``ModelParallelStrategy``, ``fully_shard`` in ``configure_model``).

::

    from runtime.adapters.lightning import PrefetchTuning

    trainer = L.Trainer(strategy=ModelParallelStrategy(), callbacks=[PrefetchTuning(study="my-job")])

The tuner is built at ``on_train_start`` on the outermost module that ``configure_model`` wrapped with
``fully_shard`` (or on ``module_of(pl_module)`` when given). One optimizer step, all its
``accumulate_grad_batches`` batches, is one ``tuner.step()``: entered at the step's first batch
(``on_train_batch_start``), left after its last (``on_train_batch_end``, after the optimizer step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError as e:  # the framework is an extra, not a core dependency
    raise ImportError("runtime.adapters.lightning needs lightning: pip install 'prefetch-planner[lightning]'") from e
from torch import nn

from runtime.adapters import root_fsdp_module
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
        self._step: Any = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.enable:
            self.tuner = AutoTuner(self.module_of(pl_module), self.study, self.storage, self.memory_budget,
                                   **self.keys)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.tuner is not None and batch_idx % trainer.accumulate_grad_batches == 0:
            self._step = self.tuner.step()
            self._step.__enter__()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0 and self._step is not None:
            step, self._step = self._step, None
            step.__exit__(None, None, None)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self._step is not None:  # the tuner records the step's trial FAIL; Lightning re-raises the exception
            step, self._step = self._step, None
            step.__exit__(type(exception), exception, exception.__traceback__)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.tuner is not None:
            self.tuner.close()
