"""The planner's error hierarchy.

Every message says what was expected, what was found, and what to do. The CLI
prints ``error: <message>`` and exits 2 for any :class:`PlannerError`.
"""

import enum


class FailKind(enum.StrEnum):
    """Why a measured trial is FAIL (its user attribute ``fail_kind``), which decides whether it is retried.

    Attributes:
        ERROR: a rank raised applying or running the plan; the plan is not
            measured again in this study.
        INTERRUPTED: the job stopped (Ctrl-C, SIGTERM, a lost rank, another
            trial's failure) before the plan was measured; the next job
            measures it.
    """

    ERROR = "error"
    INTERRUPTED = "interrupted"


class PlannerError(Exception):
    """Base class of every error this project raises on bad input.

    ``exit_code`` is what the CLI exits with (2: bad input).
    """

    exit_code = 2


class PlanFormatError(PlannerError):
    """A plan JSON is malformed, truncated, or has an unknown schema version."""


class ProfileFormatError(PlannerError):
    """A profile JSON is malformed, truncated, or has an unknown schema version."""


class TraceFormatError(PlannerError):
    """A ``torch.profiler`` trace cannot be read, is not a Kineto trace, has no FSDP2 labels, or disagrees with the
    other ranks' traces; the message names the file."""


class PlanMismatchError(PlannerError):
    """A plan was made for another model or world size than the one it is applied to."""


class SpaceParamsError(PlannerError):
    """A search space's parameters do not build a plan for this profile (``SearchSpace.build``): a parameter is
    missing (another space's, or another model's) or outside its distribution."""


class UnsupportedPlanError(PlannerError):
    """A plan uses an FSDP2 setting the running torch does not have; the message names the torch version."""


class StudyConfigError(PlannerError):
    """A study TOML is missing, malformed, names an unknown search space, or asks for what this machine lacks."""


class TargetError(PlannerError):
    """A target TOML (the cluster ``simulate --target`` predicts for) is missing, malformed, or lacks a link."""


class WorkloadError(PlannerError):
    """A workload factory cannot be imported, raises, or returns a bad workload."""


class MemoryBudgetError(PlannerError):
    """No plan fits the memory budget (even the smallest predicted peak is above it), or a relative budget has no
    measured peak to add to."""


class NotShardedError(PlannerError):
    """A model handed to the in-loop tuner is not wrapped with ``fully_shard``, or has no FSDP module but the root."""


class TensorParallelError(PlannerError):
    """A tensor-parallel layout the tuner does not plan: HSDP + TP, or FSDP modules on different TP degrees. (FSDP +
    TP, one dp mesh dim by one TP dim, is tuned.)"""


class StudyModelMismatchError(PlannerError):
    """A study was made for another model (other FSDP modules or parameter counts) than the one at hand."""


class StudyNotFoundError(PlannerError):
    """The storage holds no study of the requested name."""


class StorageError(PlannerError):
    """The storage URL cannot be opened."""


class SwitchError(PlannerError):
    """``PREFETCH_PLANNER`` holds a value that is neither on nor off (:mod:`planner.switch`); the message names the
    accepted spellings."""


class TrialFailedError(PlannerError):
    """A rank raised while measuring a trial: the trial is recorded FAIL and the job stops (CLI exit 3).

    Raised on every rank by the measured round (``runtime.measuring.round``).

    Attributes:
        local: the message is this rank's own view (a peer did not report),
            so this rank prints it even if it is not rank 0 (rank 0 may be
            the one that died).
    """

    exit_code = 3

    def __init__(self, message: str, local: bool = False):
        super().__init__(message)
        self.local = local


def one_line(e: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line, at most ``limit`` characters (for FAIL reasons and errors)."""
    text = f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
