"""The tables of a study TOML, one pydantic model each, and the names they choose from.

Each table is a pydantic model (``extra="forbid"``, strict types); a default
is written once, on its field. :mod:`planner.artifacts.config` reads a TOML
file into them (``StudyConfig``) and turns any validation error into one
line.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from planner.artifacts.json_types import JsonObject
from planner.artifacts.memory_budget import MemoryBudget
from planner.artifacts.names import Allocator, Backend, CollectiveTiming, SamplerName, SpaceName
from planner.statistics.launches import DEFAULT_SPREAD, Spread
from planner.statistics.race import RaceSettings
from planner.statistics.schedule import ConfirmSettings


class Table(BaseModel):
    """A table of the study TOML: unknown keys refused, immutable once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class StudyTable(Table):
    """``[study]``: the study's name and storage, and the measured trials' liveness.

    Attributes:
        name: the study's name (Optuna study names ``name`` and ``name.sim``).
        storage: SQLAlchemy URL of the database; ``None``:
            ``sqlite:///<toml folder>/<name>.db`` (:attr:`StudyConfig.storage_url`).
        heartbeat_interval_s: how often rank 0 records the heartbeat of its
            RUNNING measured trials (Optuna's RDB heartbeat), s.
        grace_period_s: a RUNNING trial without a heartbeat for this long is
            stale: the next job on the study fails it and re-queues its plan, s.
        max_retry: how often a stale trial's plan is re-queued (Optuna's
            stale-trial retry callback).
    """

    name: StrictStr = Field(min_length=1)
    storage: StrictStr | None = None
    heartbeat_interval_s: StrictInt = Field(10, ge=1)
    grace_period_s: StrictInt = Field(60, ge=1)
    max_retry: StrictInt = Field(2, ge=0)

    @model_validator(mode="after")
    def _grace_exceeds_heartbeat(self) -> StudyTable:
        if self.grace_period_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"grace_period_s ({self.grace_period_s}) must exceed heartbeat_interval_s "
                f"({self.heartbeat_interval_s}), or live trials would be failed as stale"
            )
        return self


class WorkloadTable(Table):
    """``[workload]``: the model, optimizer and batches every rank trains.

    Attributes:
        factory: ``"package.module:function"``, called on every rank as ``factory(mesh, **kwargs)``; it returns a
            ``runtime.Workload`` whose model is wrapped with ``fully_shard``.
        kwargs: keyword arguments of the factory.
        microbatches: forward/backward passes per optimizer step (gradient accumulation,
            ``runtime.accumulation``).
    """

    factory: StrictStr
    kwargs: JsonObject = Field(default_factory=dict)
    microbatches: StrictInt = Field(1, ge=1)


class LaunchTable(Table):
    """``[launch]``: the ranks.

    Attributes:
        nproc_per_node: ranks to start when not launched by torchrun.
        backend: ``gloo`` (CPU) or ``nccl`` (CUDA GPUs, one per rank).
        timeout_s: the longest one rank waits for another, s: the process
            group's timeout (every collective of a training step) and the
            rank protocol's (``runtime.measuring.round``).
        stuck_after_s: how long a rank may stay inside a step after a peer's step raised, s: then it is stopped
            (its NCCL communicators aborted, its process ended 10 s later; [Note: A failed step on some ranks] in
            ``planner.failed_steps``), well before the process group's ``timeout_s`` and NCCL's watchdog.
        allocator: the ranks' CPU memory allocator (:class:`Allocator`):
            ``system`` or ``jemalloc``. Tune under the one you train with:
            on CPU it sets how much of a step is page faults.
        mesh: HSDP: ``[replicate, shard]``, the 2-D device mesh the workload is sharded on
            (``init_device_mesh(device, (replicate, shard))``: parameters sharded within a shard group, replicated
            across groups); its product is the job's world size. Unset: FSDP over every rank.
        tensor_parallel: FSDP + TP: the tensor-parallel degree. The ranks start a 2-D device mesh ``(dp, tp)``
            (dims named ``"dp"`` and ``"tp"``, the TP ranks consecutive, as torchtitan lays them out within a node);
            the factory gets it whole, applies tensor parallelism over ``mesh["tp"]`` and ``fully_shard`` over
            ``mesh["dp"]``. 1: no tensor parallelism. Not with ``mesh`` (HSDP + TP is not tuned).
    """

    nproc_per_node: StrictInt = Field(2, ge=1)
    backend: Backend = Backend.GLOO
    timeout_s: StrictInt = Field(900, ge=1)
    stuck_after_s: StrictInt = Field(60, ge=1)
    allocator: Allocator = Allocator.SYSTEM
    mesh: tuple[Annotated[StrictInt, Field(ge=1)], Annotated[StrictInt, Field(ge=1)]] | None = None
    tensor_parallel: StrictInt = Field(1, ge=1)

    @model_validator(mode="after")
    def _one_2d_layout(self) -> LaunchTable:
        if self.mesh is not None and self.tensor_parallel > 1:
            raise ValueError("mesh (HSDP) with tensor_parallel > 1 is HSDP + TP, which is not tuned yet "
                             "(docs/clusters.md); set one of them")
        return self


class SearchTable(Table):
    """``[search]``: the simulated stage and how many of its plans are measured.

    Attributes:
        space: search space name (``search_spaces.SPACES``).
        sampler: Optuna sampler of the simulated stage (:data:`planner.study.samplers.SAMPLERS`):
            ``tpe``, ``nsga2`` (much cheaper per trial with hundreds of
            parameters) or ``random``.
        sim_trials: trials of the simulated stage.
        sim_timeout_s: the simulated stage stops after this long, s (Optuna's ``timeout``), even short of
            ``sim_trials``; unset: no limit (the in-loop tuner sets one: ``planner.study.in_loop``).
        measured_trials: simulated plans raced on the ranks (FSDP2's default
            races besides them; ``planner.study.select_candidates``).
        seed: the sampler's seed.
        candidate_band_pct: plans predicted within this many % of the best are
            as good as the model can tell; among them the candidates differ
            in what they do.
        memory_budget: the per-rank peak a written plan may reach
            (:class:`planner.artifacts.memory_budget.MemoryBudget`: ``"1.5GiB"``,
            ``"+150MiB"``, ``"+10%"``); unset: no budget.
    """

    space: SpaceName = SpaceName.UNIFORM
    sampler: SamplerName = SamplerName.TPE
    sim_trials: StrictInt = Field(200, ge=0)
    sim_timeout_s: StrictFloat | None = Field(None, gt=0.0)
    measured_trials: StrictInt = Field(3, ge=0)
    seed: StrictInt = 0
    candidate_band_pct: StrictFloat = Field(5.0, ge=0.0)
    memory_budget: StrictStr | None = None

    @field_validator("memory_budget")
    @classmethod
    def _parses(cls, text: str | None) -> str | None:
        if text is not None and MemoryBudget.error(text):
            raise ValueError(MemoryBudget.error(text))
        return text

    def budget(self) -> MemoryBudget | None:
        """The parsed :attr:`memory_budget`, ``None`` when unset."""
        return MemoryBudget.parse(self.memory_budget) if self.memory_budget is not None else None


class MeasureTable(Table):
    """``[measure]``: steps on the real ranks: the recorder, the race, the confirmation
    (``planner.statistics.schedule``).

    Attributes:
        warmup_steps: untimed steps per plan before measuring.
        steps: timed steps of FSDP2's default plan when recording the profile.
        profile_repeats: repeats of each recorder measurement.
        collectives: where the recorder times the all-gathers and reduce-scatters (:class:`CollectiveTiming`):
            ``"auto"`` inside traced steps on a GPU (the transfer on NCCL's clock, the wait for late ranks apart),
            in isolation on CPU; ``"in-step"`` or ``"isolated"`` either way.
        alpha: the race drops a candidate significantly slower than the
            leader; the chance of ever dropping the true best is at most this.
        min_rounds: race rounds before its first look, rounded up to whole cycles of its balanced design.
        block_rounds: race rounds between looks, rounded up to whole cycles.
        max_rounds: the race starts no block that would end after this many rounds (its first block always runs).
        time_budget_s: the race stops once it has run this long, s (at the end
            of a block); unset: no limit.
        resolve_pct: the total-time speed-up the confirmation should find "faster" with 80% power, % (its rounds
            per launch follow from the noise the race measured and the study's spread between launches; where the
            spread dominates, more launches resolve it, not more rounds, and the report says what the launches run
            can find).
        confirm_min_rounds, confirm_max_rounds: bounds on the confirmation's rounds per launch (even, >= 6: each
            pair of rounds runs both orders).
        confirm_launches: fresh launches the confirmation runs in (new ranks, models built afresh, the plan
            applied from the first step); ``0``: in the tuning job's own processes, after the race (always so
            under torchrun, where the job cannot start processes); unset: as many as the confirmation's design
            chooses for the cluster's spread, 1 to 6 (more, shorter launches where the spread dominates:
            ``planner.statistics.design``).
        launch_cost_steps: what a fresh launch costs beyond its rounds (process start, model build, warm-up), in
            steps: how the design weighs a launch against rounds.
        calibration_launches: fresh launches of the cluster's calibration (unselected plans against FSDP2's
            default: ``prefetch-planner calibrate``), run by ``tune`` where the cluster has none; ``0``: never, the
            device's prior stays the floor; unset: 12 on CUDA, whose prior is read from published repeats, 0 on
            CPU, whose prior was measured with gloo on CPU.
        calibration_rounds: paired rounds per calibration launch (even, >= 6).
        confirm_model_per_plan: in a confirmation launch, each of the two plans runs on its own model
            instance, as a user's job runs it (one plan from the first step, never switched); it costs a second
            copy of the model's state on every rank. False: one model switching plans step by step, as the race.
    """

    warmup_steps: StrictInt = Field(1, ge=0)
    steps: StrictInt = Field(5, ge=1)
    profile_repeats: StrictInt = Field(3, ge=1)
    collectives: CollectiveTiming = CollectiveTiming.AUTO
    alpha: StrictFloat = Field(0.05, gt=0.0, le=0.5)
    min_rounds: StrictInt = Field(4, ge=2)
    block_rounds: StrictInt = Field(2, ge=1)
    max_rounds: StrictInt = Field(12, ge=2)
    time_budget_s: StrictFloat | None = Field(None, gt=0.0)
    resolve_pct: StrictFloat = Field(3.0, gt=0.0, lt=100.0)
    confirm_min_rounds: StrictInt = Field(8, ge=6)
    confirm_max_rounds: StrictInt = Field(30, ge=6)
    confirm_launches: StrictInt | None = Field(None, ge=0, le=16)
    confirm_model_per_plan: StrictBool = True
    launch_cost_steps: StrictInt = Field(20, ge=0)
    calibration_launches: StrictInt | None = Field(None, ge=0, le=48)
    calibration_rounds: StrictInt = Field(12, ge=6)

    @model_validator(mode="after")
    def _bounds_in_order(self) -> MeasureTable:
        if self.max_rounds < self.min_rounds:
            raise ValueError(f"max_rounds ({self.max_rounds}) must be >= min_rounds ({self.min_rounds})")
        for key in ("confirm_min_rounds", "confirm_max_rounds", "calibration_rounds"):
            if getattr(self, key) % 2:
                raise ValueError(f"{key} ({getattr(self, key)}) must be even: each pair of the confirmation's "
                                 f"rounds runs both orders; use {getattr(self, key) + 1}")
        if self.confirm_max_rounds < self.confirm_min_rounds:
            raise ValueError(f"confirm_max_rounds ({self.confirm_max_rounds}) must be >= confirm_min_rounds "
                             f"({self.confirm_min_rounds})")
        return self

    def race_settings(self) -> RaceSettings:
        """The race these keys describe."""
        return RaceSettings(self.alpha, self.min_rounds, self.block_rounds, self.max_rounds, self.time_budget_s)

    def confirm_settings(self, launches: int | None = None, spread: Spread = DEFAULT_SPREAD,
                         floor: float = DEFAULT_SPREAD.tau) -> ConfirmSettings:
        """The confirmation these keys describe; ``launches`` overrides ``confirm_launches`` (``0`` under
        torchrun); ``spread``: the study's between-launch spread (``planner.study.evidence``); ``floor``: the
        cluster's floor of the spread (``planner.study.cluster_spread``)."""
        return ConfirmSettings(self.resolve_pct / 100.0, self.confirm_min_rounds, self.confirm_max_rounds,
                               self.confirm_launches if launches is None else launches, spread, floor,
                               self.launch_cost_steps)

    def protocol_text(self, confirm_launches: int | None) -> str:
        """The race and the confirmation these keys run, in words (``tune``'s [3/3] line); ``confirm_launches``:
        the session's (``0``: this process; ``None``: as many as the design chooses)."""
        where = ("in fresh launches, as many as the design chooses" if confirm_launches is None else
                 f"in each of {confirm_launches} fresh launches" if confirm_launches else "in this process")
        return (f"({self.warmup_steps} warm-up step each, then rounds in balanced order, at most {self.max_rounds}; "
                f"a candidate significantly slower than the leader is dropped at alpha {self.alpha:g}), then the "
                f"survivor against the baseline on {self.confirm_min_rounds}-{self.confirm_max_rounds} fresh rounds "
                f"{where}")

    def calibration_launches_for(self, device_type: str) -> int:
        """The calibration launches ``tune`` runs where the cluster has none (:attr:`calibration_launches`,
        unset: 12 on CUDA, 0 elsewhere)."""
        if self.calibration_launches is not None:
            return self.calibration_launches
        return 12 if device_type == "cuda" else 0


TABLES: dict[str, type[Table]] = {"study": StudyTable, "workload": WorkloadTable, "launch": LaunchTable,
                                   "search": SearchTable, "measure": MeasureTable}
# Every key's table: keys are unique across tables, so a flat override (the CLI's --sim-trials) finds its table.
