"""The Optuna study driver, in the style of Optuna's ``study/``: one file per part.

Two Optuna studies share the storage:

- ``NAME.sim`` (:mod:`planner.study.simulated`): the simulated stage;
  objective = predicted step ms. FSDP2's default and the search space's grid
  are enqueued first, then the sampler explores. Thousands of trials per
  minute.
- ``NAME`` (:mod:`planner.study.measured`): the measured stage; objective =
  measured step ms on the real ranks. Trials are kept alive with
  :mod:`planner.study.heartbeat`.

:mod:`planner.study.queries` answers the CLI's questions about both.
"""

from planner.study.heartbeat import Heartbeat
from planner.study.measured import MeasuredStage, MeasuredTrial
from planner.study.queries import (
    BestPlan, StudyOverview, TrialStage, best_plan, best_plan_for, confirmed_trials, list_studies,
    pareto_front, study_trials,
)
from planner.study.simulated import (
    SIM_METRICS, SIM_SUFFIX, Candidate, complete_trials, distinct_plans, plan_key, select_candidates, simulated_stage,
    smallest_peak,
)

__all__ = [
    "SIM_SUFFIX", "BestPlan", "Candidate", "Heartbeat", "MeasuredStage", "MeasuredTrial", "StudyOverview", "TrialStage",
    "best_plan", "best_plan_for", "complete_trials", "confirmed_trials", "distinct_plans", "list_studies", "plan_key", "select_candidates",
    "simulated_stage", "smallest_peak", "pareto_front", "study_trials", "SIM_METRICS",
]
