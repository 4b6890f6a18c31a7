"""Study definitions: a TOML file, validated once at the edge.

Example (``studies/llama-cpu.toml``)::

    [study]
    name = "llama-cpu"
    storage = "sqlite:///studies/llama-cpu.db"   # optional; this is the default
    heartbeat_interval_s = 10   # a measured trial's heartbeat (Optuna)
    grace_period_s = 60         # no heartbeat for this long: the trial is stale
    max_retry = 2               # re-measure a stale trial's plan at most this often

    [workload]
    factory = "runtime.workloads:llama"
    kwargs = { hidden_size = 1024, num_hidden_layers = 8 }

    [launch]
    nproc_per_node = 2
    backend = "gloo"
    timeout_s = 900       # the longest any rank waits for another

    [search]
    space = "uniform"      # or "per_module"
    sampler = "tpe"        # or "nsga2" (cheaper per trial with many parameters), "random"
    sim_trials = 200
    measured_trials = 3
    seed = 0

    [measure]
    warmup_steps = 1
    steps = 5
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.errors import StudyConfigError

_KNOWN = {
    "study": {"name", "storage", "heartbeat_interval_s", "grace_period_s", "max_retry"},
    "workload": {"factory", "kwargs"},
    "launch": {"nproc_per_node", "backend", "timeout_s"},
    "search": {"space", "sampler", "sim_trials", "measured_trials", "seed"},
    "measure": {"warmup_steps", "steps", "profile_repeats"},
}


@dataclass(frozen=True)
class StudyConfig:
    """A validated study definition.

    Attributes:
        name: the study's name (Optuna study names ``name`` and ``name.sim``).
        storage: SQLAlchemy URL of the database.
        factory: workload factory ``"package.module:function"``.
        kwargs: keyword arguments for the factory.
        nproc_per_node: ranks to start when not launched by torchrun.
        backend: ``torch.distributed`` backend (``gloo`` on CPU, ``nccl`` on GPU).
        space: search space name (see ``search_spaces``).
        sampler: Optuna sampler of the simulated stage: ``tpe``, ``nsga2``
            (much cheaper per trial with hundreds of parameters) or ``random``.
        sim_trials: trials of the simulated stage.
        measured_trials: best distinct simulated plans measured on the ranks
            (FSDP2's default is measured besides them).
        seed: the sampler's seed.
        warmup_steps: untimed steps per plan before measuring.
        steps: timed steps per plan (rounds of the interleaved measurement).
        profile_repeats: repeats of each recorder measurement.
        directory: the TOML file's folder (default outputs go there).
        timeout_s: the longest one rank waits for another, in seconds: the
            process group's timeout (every collective of a training step) and
            the rank protocol's (``runtime.protocol``).
        heartbeat_interval_s: how often rank 0 records the heartbeat of its
            RUNNING measured trials (Optuna's RDB heartbeat), in seconds.
        grace_period_s: a RUNNING trial without a heartbeat for this long is
            stale: the next job on the study fails it and re-queues its plan.
        max_retry: how often a stale trial's plan is re-queued (Optuna's
            ``RetryFailedTrialCallback``).
    """

    name: str
    storage: str
    factory: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    nproc_per_node: int = 2
    backend: str = "gloo"
    space: str = "uniform"
    sampler: str = "tpe"
    sim_trials: int = 200
    measured_trials: int = 3
    seed: int = 0
    warmup_steps: int = 1
    steps: int = 5
    profile_repeats: int = 3
    directory: str = "."
    timeout_s: int = 900
    heartbeat_interval_s: int = 10
    grace_period_s: int = 60
    max_retry: int = 2

    def default_output(self, suffix: str) -> str:
        """``<toml folder>/<name><suffix>``, e.g. ``studies/llama-cpu.plan.json``."""
        return str(Path(self.directory) / f"{self.name}{suffix}")


def default_storage(name: str, directory: str | Path = "studies") -> str:
    """``sqlite:///<directory>/<name>.db``."""
    return f"sqlite:///{Path(directory) / name}.db"


def load_study_config(path: str | Path, **overrides: Any) -> StudyConfig:
    """Read and validate a study TOML.

    Args:
        path: the TOML file.
        overrides: fields to replace (``None`` values are ignored), e.g. the
            CLI's ``storage``, ``sim_trials``, ``measured_trials``.

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
    for table, value in raw.items():
        if table not in _KNOWN or not isinstance(value, dict):
            raise StudyConfigError(f"{path}: unknown table [{table}]; expected {', '.join(sorted(_KNOWN))}")
        unknown = set(value) - _KNOWN[table]
        if unknown:
            raise StudyConfigError(f"{path}: unknown key(s) {sorted(unknown)} in [{table}]")

    def get(table: str, key: str, typ: type, default: Any = None, required: bool = False) -> Any:
        value = raw.get(table, {}).get(key, default)
        if value is None and required:
            raise StudyConfigError(f"{path}: [{table}] {key} is required")
        if value is not None and (not isinstance(value, typ) or (typ is int and isinstance(value, bool))):
            raise StudyConfigError(f"{path}: [{table}] {key} must be {typ.__name__}, found {value!r}")
        return value

    name = get("study", "name", str, required=True)
    values = {
        "name": name,
        "storage": get("study", "storage", str) or default_storage(name, path.parent),
        "factory": get("workload", "factory", str, required=True),
        "kwargs": get("workload", "kwargs", dict, {}),
        "nproc_per_node": get("launch", "nproc_per_node", int, 2),
        "backend": get("launch", "backend", str, "gloo"),
        "space": get("search", "space", str, "uniform"),
        "sampler": get("search", "sampler", str, "tpe"),
        "sim_trials": get("search", "sim_trials", int, 200),
        "measured_trials": get("search", "measured_trials", int, 3),
        "seed": get("search", "seed", int, 0),
        "warmup_steps": get("measure", "warmup_steps", int, 1),
        "steps": get("measure", "steps", int, 5),
        "profile_repeats": get("measure", "profile_repeats", int, 3),
        "directory": str(path.parent),
        "timeout_s": get("launch", "timeout_s", int, 900),
        "heartbeat_interval_s": get("study", "heartbeat_interval_s", int, 10),
        "grace_period_s": get("study", "grace_period_s", int, 60),
        "max_retry": get("study", "max_retry", int, 2),
    }
    values.update({k: v for k, v in overrides.items() if v is not None})
    for key in ("nproc_per_node", "steps", "profile_repeats", "timeout_s", "heartbeat_interval_s"):
        if values[key] < 1:
            raise StudyConfigError(f"{path}: {key} must be >= 1, found {values[key]}")
    for key in ("sim_trials", "measured_trials", "warmup_steps", "max_retry"):
        if values[key] < 0:
            raise StudyConfigError(f"{path}: {key} must be >= 0, found {values[key]}")
    from planner.study import SAMPLERS
    from search_spaces import get_space

    if values["sampler"] not in SAMPLERS:
        raise StudyConfigError(f"{path}: unknown sampler {values['sampler']!r}; choose one of {', '.join(SAMPLERS)}")

    if values["grace_period_s"] <= values["heartbeat_interval_s"]:
        raise StudyConfigError(
            f"{path}: grace_period_s ({values['grace_period_s']}) must exceed heartbeat_interval_s "
            f"({values['heartbeat_interval_s']}), or live trials would be failed as stale"
        )
    get_space(values["space"])  # raises StudyConfigError naming the choices
    return StudyConfig(**values)
