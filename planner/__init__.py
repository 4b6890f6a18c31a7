"""prefetch-planner: profile → simulate → search → plan, for PyTorch FSDP2.

Pure Python + NumPy: importing ``planner`` never imports torch.
"""

from planner.errors import (
    PlanFormatError,
    PlanMismatchError,
    PlannerError,
    ProfileFormatError,
    StorageError,
    StudyConfigError,
    StudyNotFoundError,
    TrialFailedError,
    UnsupportedPlanError,
    WorkloadError,
)
from planner.artifacts.plan import ModulePlan, Plan, Provenance
from planner.artifacts.profile import Fingerprint, ModuleProfile, Profile
from planner.simulation.simulator import SimParams, SimResult, simulate

__all__ = [
    "Fingerprint", "ModulePlan", "ModuleProfile", "Plan", "PlanFormatError", "PlanMismatchError",
    "PlannerError", "Profile", "ProfileFormatError", "Provenance", "SimParams", "SimResult",
    "StorageError", "StudyConfigError", "StudyNotFoundError", "TrialFailedError", "UnsupportedPlanError",
    "WorkloadError",
    "simulate",
]
