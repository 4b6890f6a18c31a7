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
    allocator = "system"  # or "jemalloc" (preloaded, keeps its pages: no page faults in a CPU step)

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

import tomllib
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from planner.artifacts.json_types import JsonObject
from planner.artifacts.names import Backend, SamplerName, SpaceName
from planner.artifacts.tables import TABLES, LaunchTable, MeasureTable, SearchTable, StudyTable, Table, WorkloadTable
from planner.errors import PlannerError, StudyConfigError

__all__ = [
    "Backend", "LaunchTable", "MeasureTable", "SamplerName", "SearchTable", "SpaceName", "StudyConfig", "StudyTable",
    "WorkloadTable", "default_storage", "load_study_config",
]

_TABLE_OF: dict[str, str] = {key: table for table, model in TABLES.items() for key in model.model_fields}


class StudyConfig(Table):
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

    def to_validated_json(self) -> str:
        """This config as JSON, for processes that take it validated (:meth:`from_validated_json`)."""
        return self.model_dump_json()

    @classmethod
    def from_validated_json(cls, text: str) -> StudyConfig:
        """The config :meth:`to_validated_json` wrote (the ranks of a launch read this, not the TOML).

        Raises:
            StudyConfigError: the text is not such a config (written by another prefetch-planner).
        """
        try:
            return cls.model_validate_json(text)
        except ValidationError as e:
            problem = e.errors()[0]["msg"]
            raise StudyConfigError(f"the validated study config handed to this rank does not load ({problem}); "
                                   "launch the job again with this prefetch-planner") from None

    @classmethod
    def build(cls, directory: str | Path = ".", source: str = "study config", **fields: Any) -> StudyConfig:
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
    return _validate(read_toml(path, "study", StudyConfigError), path.parent, str(path), overrides)


def read_toml(path: Path, what: str, error: type[PlannerError]) -> dict[str, Any]:
    """The TOML file at ``path`` as a dict; ``what`` names it in the errors (``"study"``: "study file ...").

    Raises:
        error: the file cannot be read, or is not valid TOML (one line).
    """
    try:
        return tomllib.loads(path.read_text())
    except OSError as e:
        raise error(f"cannot read {what} file {str(path)!r}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise error(f"{what} file {str(path)!r} is not valid TOML: {e}") from None


def _validate(raw: JsonObject, directory: str | Path, source: str, overrides: JsonObject) -> StudyConfig:
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
