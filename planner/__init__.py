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
from planner.plan import ModulePlan, Plan, Provenance
from planner.profile import Fingerprint, ModuleProfile, Profile
from planner.simulator import SimParams, SimResult, simulate

__all__ = [
    "Fingerprint", "ModulePlan", "ModuleProfile", "Plan", "PlanFormatError", "PlanMismatchError",
    "PlannerError", "Profile", "ProfileFormatError", "Provenance", "SimParams", "SimResult",
    "StorageError", "StudyConfigError", "StudyNotFoundError", "TrialFailedError", "UnsupportedPlanError",
    "WorkloadError",
    "simulate",
]
