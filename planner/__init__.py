"""prefetch-planner: profile → simulate → search → plan, for PyTorch FSDP2.

Pure Python + NumPy: importing ``planner`` never imports torch, and imports
nothing else until a name is used (:mod:`planner.lazy_exports`). The rooms:
``artifacts`` (profile, plan, study config), ``simulation``, ``statistics``
(race, confirmation, verdict), ``study`` (Optuna), ``storages`` and
``presentation`` (CLI, plots, reports).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from planner.artifacts.fingerprint import Fingerprint
    from planner.artifacts.plan import ModulePlan, Plan, Provenance
    from planner.artifacts.profile import ModuleProfile, Profile
    from planner.errors import (
        MemoryBudgetError,
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
    from planner.simulation.parameters import simulate
    from planner.simulation.simulator import SimParams, SimResult, Simulator

_EXPORTS = {
    **dict.fromkeys(["MemoryBudgetError", "PlanFormatError", "PlanMismatchError", "PlannerError", "ProfileFormatError",
                     "StorageError", "StudyConfigError", "StudyNotFoundError", "TrialFailedError",
                     "UnsupportedPlanError", "WorkloadError"], "planner.errors"),
    **dict.fromkeys(["ModulePlan", "Plan", "Provenance"], "planner.artifacts.plan"),
    "Fingerprint": "planner.artifacts.fingerprint",
    **dict.fromkeys(["ModuleProfile", "Profile"], "planner.artifacts.profile"),
    **dict.fromkeys(["SimParams", "SimResult", "Simulator"], "planner.simulation.simulator"),
    "simulate": "planner.simulation.parameters",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
