"""The runtime: record profiles, apply plans, measure plans on real FSDP2 ranks.

Training start::

    from runtime import load_plan, load_best_plan, apply_plan
    apply_plan(model, load_plan("plan.json"))
    apply_plan(model, load_best_plan("postgresql+psycopg2://planner@db/studies", "llama", model))
"""

from planner.errors import PlanFormatError, PlanMismatchError, UnsupportedPlanError, WorkloadError
from runtime.apply import apply_plan, load_best_plan, load_plan, model_fingerprint
from runtime.workload import Workload, build_workload, fsdp_modules, load_factory, train_step

__all__ = [
    "PlanFormatError", "PlanMismatchError", "UnsupportedPlanError", "Workload", "WorkloadError", "apply_plan",
    "build_workload",
    "fsdp_modules", "load_best_plan", "load_factory", "load_plan", "model_fingerprint", "train_step",
]
