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
step). The Trainer calls no callback when a step raises, so such a step is not recorded FAIL by the tuner; the
study's heartbeat marks its trials stale and the next tuner measures them again.
"""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as e:  # the framework is an extra, not a core dependency
    raise ImportError("runtime.adapters.hf needs transformers: pip install 'prefetch-planner[hf]'") from e

from planner.errors import NotShardedError
from runtime.adapters import root_fsdp_module
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
        self._step: Any = None

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if not self.enable:
            return
        if self.tuner is None:  # Accelerate shards the model after on_train_begin: the first step sees it sharded
            self.tuner = AutoTuner(sharded_model(args, model), self.study, self.storage, self.memory_budget,
                                   **self.keys)
        self._step = self.tuner.step()
        self._step.__enter__()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step, self._step = self._step, None
        if step is not None:
            step.__exit__(None, None, None)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.tuner is not None:
            self.tuner.close()  # training ended before the tuning did: FSDP2's default, trials FAIL (interrupted)


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
