"""Study definitions: a TOML file, validated once at the edge into typed tables.

Example (``studies/llama-cpu.toml``)::

    [study]
    name = "llama-cpu"
    storage = "sqlite:///studies/llama-cpu.db"   # optional; this is the default
    heartbeat_interval_s = 10   # a measured trial's heartbeat (Optuna)
    grace_period_s = 60         # no heartbeat for this long: the trial is stale
    max_retry = 2               # re-measure a stale trial's plan at most this often

    [workload]
    factory = "runtime.reference_workloads:llama"
    kwargs = { hidden_size = 1024, num_hidden_layers = 8 }

    [launch]
    nproc_per_node = 2
    backend = "gloo"
    timeout_s = 900       # the longest any rank waits for another

    [search]
    space = "uniform"      # or "per_module", "assign"
    sampler = "tpe"        # or "nsga2" (cheaper per trial with many parameters), "random"
    sim_trials = 200
    measured_trials = 3
    memory_budget = "+150MiB"  # or "1.5GiB", "+10%"; unset: no budget

    [measure]
    warmup_steps = 1
    steps = 5

Each table is a pydantic model (``extra="forbid"``, strict types); a default
is written once, on its field. Any error is one :class:`StudyConfigError`
line naming the file, the table and key, and what to write instead.
"""

from __future__ import annotations

import enum
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, ValidationError, field_validator, model_validator

from planner.errors import StudyConfigError
from planner.memory_budget import MemoryBudget
from planner.race import RaceSettings
from planner.samplers import SAMPLERS
from planner.schedule import ConfirmSettings
from search_spaces import SPACES


class Backend(enum.StrEnum):
    """``torch.distributed`` backend of the ranks: ``gloo`` on CPU, ``nccl`` on CUDA GPUs."""

    GLOO = "gloo"
    NCCL = "nccl"


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StudyTable(_Table):
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
    def _grace_exceeds_heartbeat(self) -> "StudyTable":
        if self.grace_period_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"grace_period_s ({self.grace_period_s}) must exceed heartbeat_interval_s "
                f"({self.heartbeat_interval_s}), or live trials would be failed as stale"
            )
        return self


class WorkloadTable(_Table):
    """``[workload]``: ``factory`` ``"package.module:function"``, called on every rank as ``factory(mesh, **kwargs)``;
    ``microbatches``: forward/backward passes per optimizer step (gradient accumulation, ``runtime.accumulation``)."""

    factory: StrictStr
    kwargs: dict[str, Any] = Field(default_factory=dict)
    microbatches: StrictInt = Field(1, ge=1)


class LaunchTable(_Table):
    """``[launch]``: the ranks.

    Attributes:
        nproc_per_node: ranks to start when not launched by torchrun.
        backend: ``gloo`` (CPU) or ``nccl`` (CUDA GPUs, one per rank).
        timeout_s: the longest one rank waits for another, s: the process
            group's timeout (every collective of a training step) and the
            rank protocol's (``runtime.protocol``).
    """

    nproc_per_node: StrictInt = Field(2, ge=1)
    backend: Backend = Backend.GLOO
    timeout_s: StrictInt = Field(900, ge=1)


class SearchTable(_Table):
    """``[search]``: the simulated stage and how many of its plans are measured.

    Attributes:
        space: search space name (``search_spaces.SPACES``).
        sampler: Optuna sampler of the simulated stage (:data:`planner.samplers.SAMPLERS`):
            ``tpe``, ``nsga2`` (much cheaper per trial with hundreds of
            parameters) or ``random``.
        sim_trials: trials of the simulated stage.
        measured_trials: simulated plans raced on the ranks (FSDP2's default
            races besides them; ``planner.study.select_candidates``).
        seed: the sampler's seed.
        candidate_band_pct: plans predicted within this many % of the best are
            as good as the model can tell; among them the candidates differ
            in what they do.
        memory_budget: the per-rank peak a written plan may reach
            (:class:`planner.memory_budget.MemoryBudget`: ``"1.5GiB"``,
            ``"+150MiB"``, ``"+10%"``); unset: no budget.
    """

    space: StrictStr = "uniform"
    sampler: StrictStr = "tpe"
    sim_trials: StrictInt = Field(200, ge=0)
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

    @field_validator("space")
    @classmethod
    def _known_space(cls, name: str) -> str:
        if name not in SPACES:
            raise ValueError(f"unknown search space {name!r}; choose one of {', '.join(sorted(SPACES))}")
        return name

    @field_validator("sampler")
    @classmethod
    def _known_sampler(cls, name: str) -> str:
        if name not in SAMPLERS:
            raise ValueError(f"unknown sampler {name!r}; choose one of {', '.join(SAMPLERS)}")
        return name


class MeasureTable(_Table):
    """``[measure]``: steps on the real ranks: the recorder, the race, the confirmation (``planner.schedule``).

    Attributes:
        warmup_steps: untimed steps per plan before measuring.
        steps: timed steps of FSDP2's default plan when recording the profile.
        profile_repeats: repeats of each recorder measurement.
        alpha: the race drops a candidate significantly slower than the
            leader; the chance of ever dropping the true best is at most this.
        min_rounds: race rounds before its first look.
        block_rounds: race rounds between looks.
        max_rounds: the race stops after this many rounds.
        time_budget_s: the race stops once it has run this long, s (at the end
            of a block); unset: no limit.
        resolve_pct: the difference the confirmation should resolve, %
            (its rounds follow from the noise the race measured).
        confirm_min_rounds, confirm_max_rounds: bounds on the confirmation's rounds.
    """

    warmup_steps: StrictInt = Field(1, ge=0)
    steps: StrictInt = Field(5, ge=1)
    profile_repeats: StrictInt = Field(3, ge=1)
    alpha: StrictFloat = Field(0.05, gt=0.0, le=0.5)
    min_rounds: StrictInt = Field(4, ge=2)
    block_rounds: StrictInt = Field(2, ge=1)
    max_rounds: StrictInt = Field(12, ge=2)
    time_budget_s: StrictFloat | None = Field(None, gt=0.0)
    resolve_pct: StrictFloat = Field(3.0, gt=0.0, lt=100.0)
    confirm_min_rounds: StrictInt = Field(8, ge=4)
    confirm_max_rounds: StrictInt = Field(30, ge=4)

    @model_validator(mode="after")
    def _bounds_in_order(self) -> "MeasureTable":
        if self.max_rounds < self.min_rounds:
            raise ValueError(f"max_rounds ({self.max_rounds}) must be >= min_rounds ({self.min_rounds})")
        if self.confirm_max_rounds < self.confirm_min_rounds:
            raise ValueError(f"confirm_max_rounds ({self.confirm_max_rounds}) must be >= confirm_min_rounds "
                             f"({self.confirm_min_rounds})")
        return self

    def race_settings(self) -> RaceSettings:
        """The race these keys describe."""
        return RaceSettings(self.alpha, self.min_rounds, self.block_rounds, self.max_rounds, self.time_budget_s)

    def confirm_settings(self, seed: int = 0) -> ConfirmSettings:
        """The confirmation these keys describe."""
        return ConfirmSettings(self.resolve_pct / 100.0, self.confirm_min_rounds, self.confirm_max_rounds, seed)


TABLES: dict[str, type[_Table]] = {"study": StudyTable, "workload": WorkloadTable, "launch": LaunchTable,
                                   "search": SearchTable, "measure": MeasureTable}
# Every key's table: keys are unique across tables, so a flat override (the CLI's --sim-trials) finds its table.
_TABLE_OF: dict[str, str] = {key: table for table, model in TABLES.items() for key in model.model_fields}


class StudyConfig(_Table):
    """A validated study definition: one typed model per TOML table.

    Attributes:
        study, workload, launch, search, measure: the tables.
        directory: the TOML file's folder (default outputs and the default
            SQLite storage go there); not a TOML key.
    """

    study: StudyTable
    workload: WorkloadTable
    launch: LaunchTable = Field(default_factory=LaunchTable)
    search: SearchTable = Field(default_factory=SearchTable)
    measure: MeasureTable = Field(default_factory=MeasureTable)
    directory: str = "."

    @property
    def name(self) -> str:
        """``[study] name``."""
        return self.study.name

    @property
    def storage_url(self) -> str:
        """``[study] storage``, else ``sqlite:///<directory>/<name>.db``."""
        return self.study.storage or default_storage(self.study.name, self.directory)

    def default_output(self, suffix: str) -> str:
        """``<toml folder>/<name><suffix>``, e.g. ``studies/llama-cpu.plan.json``."""
        return str(Path(self.directory) / f"{self.name}{suffix}")

    @classmethod
    def build(cls, directory: str | Path = ".", source: str = "study config", **fields: Any) -> "StudyConfig":
        """A config from flat keys (``name=..., factory=..., sim_trials=...``), each put in its table.

        The Python API's way to write what a TOML file says; validated the
        same way.

        Raises:
            StudyConfigError: an unknown key, or a value of the wrong type or range.
        """
        return _validate({}, directory, source, fields)


def default_storage(name: str, directory: str | Path = "studies") -> str:
    """``sqlite:///<directory>/<name>.db``."""
    return f"sqlite:///{Path(directory) / name}.db"


def load_study_config(path: str | Path, **overrides: Any) -> StudyConfig:
    """Read and validate a study TOML.

    Args:
        path: the TOML file.
        overrides: flat keys to replace (``None`` values are ignored), e.g.
            the CLI's ``storage``, ``sim_trials``, ``measured_trials``;
            validated like the file's own.

    Raises:
        StudyConfigError: missing file, malformed TOML, unknown table or key,
            or a value of the wrong type or range.
    """
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as e:
        raise StudyConfigError(f"cannot read study file {str(path)!r}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise StudyConfigError(f"study file {str(path)!r} is not valid TOML: {e}") from None
    return _validate(raw, path.parent, str(path), overrides)


def _validate(raw: dict[str, Any], directory: str | Path, source: str, overrides: dict[str, Any]) -> StudyConfig:
    for table, value in raw.items():
        if table not in TABLES:
            raise StudyConfigError(f"{source}: unknown table [{table}]; expected {', '.join(sorted(TABLES))}")
        if not isinstance(value, dict):
            raise StudyConfigError(f"{source}: {table} must be a table: write [{table}] and its keys below it")
    tables = {table: dict(raw.get(table, {})) for table in TABLES}
    for key, value in overrides.items():
        if key not in _TABLE_OF:
            raise StudyConfigError(f"{source}: unknown key {key!r}; keys are {', '.join(sorted(_TABLE_OF))}")
        if value is not None:
            tables[_TABLE_OF[key]][key] = value
    try:
        return StudyConfig.model_validate({**tables, "directory": str(directory)})
    except ValidationError as e:
        raise StudyConfigError(f"{source}: {_describe(e)}") from None


def _describe(error: ValidationError) -> str:
    """The first problem of a pydantic error as ``[table] key ...`` with what to write instead."""
    errors = error.errors()
    first = errors[0]
    loc = [str(part) for part in first["loc"]]
    table, key = loc[0], ".".join(loc[1:])
    where = f"[{table}] {key}" if key else f"[{table}]"
    kind, found = first["type"], first.get("input")
    if kind == "extra_forbidden":
        unknown = sorted(".".join(map(str, e["loc"][1:])) for e in errors
                         if e["type"] == "extra_forbidden" and e["loc"][0] == first["loc"][0])
        return (f"unknown key(s) {unknown} in [{table}]; "
                f"keys there are {', '.join(sorted(TABLES[table].model_fields))}")
    if kind == "missing":
        return f"{where} is required"
    if kind in ("int_type", "string_type", "dict_type", "float_type"):
        expected = {"int_type": "int", "string_type": "str", "dict_type": "dict", "float_type": "a number"}[kind]
        return f"{where} must be {expected}, found {found!r}"
    if kind == "string_too_short":
        return f"{where} must not be empty"
    comparisons = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le"),
                   "less_than": ("<", "lt")}
    if kind in comparisons:
        sign, key = comparisons[kind]
        return f"{where} must be {sign} {first['ctx'][key]}, found {found!r}"
    if kind == "enum":
        return f"{where} must be one of {first['ctx']['expected']}, found {found!r}"
    if kind == "value_error":
        message = str(first["ctx"]["error"])
        return f"{where}: {message}" if key else f"{where} {message}"
    return f"{where}: {first['msg']}"
