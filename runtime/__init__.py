"""The runtime: record profiles, apply plans, measure plans on real FSDP2 ranks.

Tuning inside one's own training loop::

    tuner = AutoTuner(model, study="my-job", storage="sqlite:///tuning.db", memory_budget="+10%")
    for batch in loader:
        with tuner.step():
            ...  # forward, backward, optimizer step

Training start::

    from runtime import load_plan, load_best_plan, apply_plan
    apply_plan(model, load_plan("plan.json"))
    apply_plan(model, load_best_plan("postgresql+psycopg2://planner@db/studies", "llama", model))

What a model has now (its hand-set prefetch, resharding and knobs)::

    from runtime import current_plan
    current_plan(model).to_json("mine.json")

Importing ``runtime`` does no work: each name imports its module (and torch)
when first used (:mod:`planner.lazy_exports`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from planner.errors import PlanFormatError, PlanMismatchError, UnsupportedPlanError, WorkloadError
    from runtime.apply import apply_plan, load_best_plan, load_plan, model_fingerprint
    from runtime.current import current_plan
    from runtime.in_loop.autotuner import AutoTuner
    from runtime.workload import Workload, build_workload, fsdp_modules, load_factory, train_step

_EXPORTS = {
    **dict.fromkeys(["PlanFormatError", "PlanMismatchError", "UnsupportedPlanError", "WorkloadError"],
                    "planner.errors"),
    **dict.fromkeys(["apply_plan", "load_best_plan", "load_plan", "model_fingerprint"], "runtime.apply"),
    "current_plan": "runtime.current",
    "AutoTuner": "runtime.in_loop.autotuner",
    **dict.fromkeys(["Workload", "build_workload", "fsdp_modules", "load_factory", "train_step"], "runtime.workload"),
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
