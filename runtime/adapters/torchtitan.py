"""``runtime.AutoTuner`` in torchtitan's ``Trainer`` (torchtitan 0.3, extra ``prefetch-planner[torchtitan]``).

torchtitan has no callback registry; a trainer is extended by subclassing it with its own ``Config``, as its
``FluxTrainer`` does. :class:`TunedTrainer` is torchtitan's ``Trainer`` with a ``prefetch_tuning`` section, and
:func:`tuned` turns any torchtitan ``Trainer.Config`` (a ``config_registry`` function's, or what
``ConfigManager().parse_args()`` returns) into one::

    from torchtitan.config import ConfigManager
    from runtime.adapters.torchtitan import tuned

    config = tuned(ConfigManager().parse_args(), study="llama3-8b", storage="postgresql://.../studies")
    trainer = config.build()
    trainer.train()
    trainer.close()

The tuner is built at the end of ``Trainer.__init__``: after ``parallelize`` (``fully_shard`` on each block and the
root), the weights' initialization and the optimizer, on ``model_parts[0]``, the FSDP2 root. One ``train_step``,
all its gradient-accumulation microbatches, is one ``tuner.step()``. ``close`` closes the tuner first: training
that ends before the tuning does keeps the baseline, its trials FAIL (interrupted).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

try:
    from torchtitan.trainer import Trainer
except ImportError as e:  # the framework is an extra, not a core dependency
    raise ImportError("runtime.adapters.torchtitan needs torchtitan: pip install 'prefetch-planner[torchtitan]'") from e

from planner.errors import UnsupportedPlanError
from runtime.adapters import root_fsdp_module
from runtime.in_loop.autotuner import AutoTuner


@dataclass(kw_only=True, slots=True)
class PrefetchTuningConfig:
    """The ``prefetch_tuning`` section of :class:`TunedTrainer.Config` (``--prefetch_tuning.study`` on
    torchtitan's command line): :class:`runtime.AutoTuner`'s arguments.

    Attributes:
        enable: build the tuner (``False``: torchtitan's ``Trainer`` as it is).
        study: the study's name.
        storage: the study's SQLAlchemy URL (``None``: ``sqlite:///studies/NAME.db`` in the working directory).
        memory_budget: the per-rank peak a plan may reach (``"+10%"``, ``"60GiB"``; ``None``: on CUDA what the
            device has free less 10% of it).
        plan_out: where rank 0 writes the plan the tuning ends with (``None``: not written).
        on_oom: ``"skip"`` or ``"raise"``, as :class:`runtime.AutoTuner`'s.
        keys: other study keys (``{"sim_trials": 400, "min_rounds": 4}``), as :class:`runtime.AutoTuner`'s.
    """

    enable: bool = True
    study: str = "torchtitan"
    storage: str | None = None
    memory_budget: str | None = None
    plan_out: str | None = None
    on_oom: str = "skip"
    keys: dict[str, int | float | str] = field(default_factory=dict)


class TunedTrainer(Trainer):
    """torchtitan's ``Trainer``, each ``train_step`` one step of a :class:`runtime.AutoTuner`.

    Attributes:
        tuner: the :class:`runtime.AutoTuner` (``None`` with ``prefetch_tuning.enable = False``).

    Raises:
        UnsupportedPlanError: pipeline parallelism (more than one model part): the tuner takes one FSDP root.
        NotShardedError: the model part is not wrapped with ``fully_shard`` (``data_parallel_shard_degree`` 1).
        TensorParallelError: HSDP + TP (``data_parallel_replicate_degree`` > 1 with ``tensor_parallel_degree`` > 1),
            not tuned yet. FSDP + TP (``tensor_parallel_degree`` > 1, FSDP over ``data_parallel_shard_degree``) is
            tuned: every rank of the mesh applies the same plan.
        StudyConfigError, StorageError: as :class:`runtime.AutoTuner`.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        prefetch_tuning: PrefetchTuningConfig = field(default_factory=PrefetchTuningConfig)
        """The prefetch tuner's arguments."""

    def __init__(self, config: Config):
        super().__init__(config)
        self.tuner: AutoTuner | None = None
        tuning = config.prefetch_tuning
        if not tuning.enable:
            return
        if len(self.model_parts) != 1:
            raise UnsupportedPlanError(f"TunedTrainer: {len(self.model_parts)} model parts (pipeline parallelism); "
                                       "the prefetch tuner takes one FSDP root: set prefetch_tuning.enable = false")
        self.tuner = AutoTuner(root_fsdp_module(self.model_parts[0]), tuning.study, tuning.storage,
                               tuning.memory_budget, plan_out=tuning.plan_out, on_oom=tuning.on_oom, **tuning.keys)

    def train_step(self, data_iterator: Any) -> None:
        if self.tuner is None:
            return super().train_step(data_iterator)
        with self.tuner.step():
            return super().train_step(data_iterator)

    def close(self) -> None:
        if self.tuner is not None:
            self.tuner.close()  # training ended before the tuning did: the baseline stays, trials FAIL (interrupted)
        super().close()


def tuned(config: Trainer.Config, **prefetch_tuning: Any) -> TunedTrainer.Config:
    """``config`` (any torchtitan ``Trainer.Config``) as a :class:`TunedTrainer.Config` with the same values.

    Args:
        config: a torchtitan trainer configuration.
        **prefetch_tuning: :class:`PrefetchTuningConfig`'s fields (``study=``, ``storage=``, ``keys=``, ...).

    Returns:
        the configuration whose ``build()`` makes a :class:`TunedTrainer`.

    Raises:
        TypeError: a keyword that is not a :class:`PrefetchTuningConfig` field.
    """
    values = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
    values["prefetch_tuning"] = PrefetchTuningConfig(**prefetch_tuning)
    return TunedTrainer.Config(**values)
