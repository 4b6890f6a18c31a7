"""``runtime.AutoTuner`` in Hugging Face ``transformers.Trainer``.

::

    from runtime.adapters.hf import PrefetchTuningCallback

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[PrefetchTuningCallback(study="my-job", storage="sqlite:///tuning.db")])

The model is FSDP2-sharded one of two ways: by transformers itself
(``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=N))``, on GPUs and on CPU with gloo), or by
Accelerate's FSDP plugin (``TrainingArguments(fsdp=..., fsdp_config={"fsdp_version": 2})``, GPUs only: on CPU
Accelerate keeps the plugin only for accelerators and trains the model under DDP, which the callback names in its
error). The tuner is built at the first ``on_step_begin`` on the model the trainer trains (Accelerate applies
``fully_shard`` after ``on_train_begin``).
One optimizer step of the Trainer, all its gradient-accumulation microbatches, is one ``tuner.step()``: it is
entered at ``on_step_begin`` (the step's first microbatch) and left at ``on_step_end`` (after the optimizer
step).

A callback never sees a step that raises: the Trainer calls none. To keep the tuner's promise for a candidate that
runs out of memory (``on_oom="skip"``: the step skipped, the trial FAIL, training going on), train with
:class:`TunedTrainer`, or mix :class:`PrefetchTuningMixin` into a Trainer subclass of your own (first among its
bases): its ``training_step`` hands the error to the tuner, and where the tuner skips the step, that microbatch and
the step's others return a zero loss without running, so the optimizer step finds no gradient and changes nothing.

::

    trainer = TunedTrainer(model=model, args=args, train_dataset=data,
                           callbacks=[PrefetchTuningCallback(study="my-job")])
"""

from __future__ import annotations

from typing import Any

import torch

try:
    from transformers import Trainer, TrainerCallback
except ImportError as e:  # the framework is an extra, not a core dependency
    raise ImportError("runtime.adapters.hf needs transformers: pip install 'prefetch-planner[hf]'") from e

from planner.errors import NotShardedError
from runtime.adapters import HeldStep, root_fsdp_module
from runtime.in_loop.autotuner import AutoTuner


class PrefetchTuningCallback(TrainerCallback):
    """A ``TrainerCallback`` that tunes FSDP2's prefetch on the Trainer's own steps.

    Args:
        study: the study's name, as :class:`runtime.AutoTuner`'s.
        storage: the study's SQLAlchemy URL (``None``: ``sqlite:///studies/NAME.db``), as :class:`runtime.AutoTuner`'s.
        memory_budget: the per-rank peak a plan may reach (``"+20%"``, ``"1.5GiB"``), as
            :class:`runtime.AutoTuner`'s.
        enable: build the tuner (``False``: the callback does nothing, the Trainer trains as it would without it).
        **keys: :class:`runtime.AutoTuner`'s other keywords (``plan_out=``, ``recheck=``, any study key).

    Attributes:
        tuner: the :class:`runtime.AutoTuner` from the first step on (``None`` before, and with ``enable=False``).
    """

    def __init__(self, study: str, storage: str | None = None, memory_budget: str | None = None,
                 enable: bool = True, **keys: Any):
        self.study, self.storage, self.memory_budget, self.keys = study, storage, memory_budget, keys
        self.enable = enable
        self.tuner: AutoTuner | None = None
        self._held = HeldStep()

    @property
    def skipping(self) -> bool:
        """The tuner skipped this optimizer step (:meth:`skip`): its other microbatches are not run."""
        return self._held.skipping

    def skip(self, error: BaseException) -> bool:
        """A microbatch of this optimizer step raised ``error``: ``True`` if the tuner skipped the step
        (``runtime.adapters.HeldStep.skip``), ``False`` if the error is the caller's to raise."""
        return self._held.skip(error)

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if not self.enable:
            return
        if self.tuner is None:  # Accelerate shards the model after on_train_begin: the first step sees it sharded
            self.tuner = AutoTuner(sharded_model(args, model), self.study, self.storage, self.memory_budget,
                                   **self.keys)
        self._held.enter(self.tuner)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._held.leave()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.tuner is not None:
            self.tuner.close()  # training ended before the tuning did: FSDP2's default, trials FAIL (interrupted)


class PrefetchTuningMixin:
    """Mixed into a ``transformers.Trainer`` (first among the bases) with a :class:`PrefetchTuningCallback` among its
    callbacks: an error inside ``training_step`` goes to the tuner, which skips a candidate's out-of-memory step
    (:meth:`PrefetchTuningCallback.skip`); the skipped step's microbatches return a zero loss without running."""

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        callback = next((c for c in self.callback_handler.callbacks if isinstance(c, PrefetchTuningCallback)), None)
        if callback is not None and callback.skipping:
            return torch.zeros((), device=self.args.device)
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        except Exception as e:
            if callback is None or not callback.skip(e):
                raise
            model.zero_grad(set_to_none=True)  # the microbatches before it in this step: nothing reaches the optimizer
            return torch.zeros((), device=self.args.device)


class TunedTrainer(PrefetchTuningMixin, Trainer):
    """``transformers.Trainer`` whose candidate steps that run out of memory the tuner skips
    (:class:`PrefetchTuningMixin`); pass a :class:`PrefetchTuningCallback` in ``callbacks``."""


def sharded_model(args: Any, model: Any) -> Any:
    """The FSDP2 root of the model the Trainer trains.

    Raises:
        NotShardedError: nothing in ``model`` is wrapped with ``fully_shard``; when ``args`` asks Accelerate for
            FSDP (``TrainingArguments(fsdp=...)``), the error says that Accelerate trains it under DDP instead
            (it keeps its FSDP plugin only on accelerators) and how to shard it with transformers on CPU.
    """
    try:
        return root_fsdp_module(model)
    except NotShardedError:
        if not getattr(args, "fsdp", None):
            raise
        raise NotShardedError(
            f"PrefetchTuningCallback: TrainingArguments(fsdp={args.fsdp!r}) asks Accelerate for FSDP, but the Trainer "
            "trains the model unsharded (on CPU Accelerate keeps its FSDP plugin only for GPUs and falls back to "
            "DDP); shard it with from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=N)) instead"
        ) from None
