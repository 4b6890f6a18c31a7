"""The Optuna study driver, in the style of Optuna's ``study/``: one file per part.

Two Optuna studies share the storage:

- ``NAME.sim`` (:mod:`planner.study.simulated`): the simulated stage; two
  objectives, predicted step ms and peak bytes. FSDP2's default and the
  search space's grid are enqueued first, then the sampler explores.
- ``NAME`` (:mod:`planner.study.measured`): the measured stage; objective =
  measured step ms on the real ranks, for the candidates
  (:mod:`planner.study.candidates`). Trials are kept alive with
  :mod:`planner.study.heartbeat`.

:mod:`planner.study.queries` answers the CLI's questions about both. Names
are imported on first use (:mod:`planner.lazy_exports`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from planner.study.candidates import Candidate, distinct_plans, plan_key, select_candidates
    from planner.study.forget import Forgotten, forget_study
    from planner.study.heartbeat import Heartbeat
    from planner.study.measured import MeasuredStage, MeasuredTrial
    from planner.study.queries import (
        BestPlan,
        StudyOverview,
        TrialView,
        best_plan,
        best_plan_for,
        list_studies,
        pareto_front,
        read_trial,
        study_trials,
    )
    from planner.study.recommendation import JobVerdict, Recommendation, confirmation_history, job_verdicts, recommend
    from planner.study.search_space import SearchSpace
    from planner.study.simulated import SIM_METRICS, SIM_SUFFIX, complete_trials, simulated_stage, smallest_peak

_EXPORTS = {
    **dict.fromkeys(["Candidate", "distinct_plans", "plan_key", "select_candidates"], "planner.study.candidates"),
    **dict.fromkeys(["Forgotten", "forget_study"], "planner.study.forget"),
    "Heartbeat": "planner.study.heartbeat",
    **dict.fromkeys(["MeasuredStage", "MeasuredTrial"], "planner.study.measured"),
    **dict.fromkeys(["BestPlan", "StudyOverview", "TrialView", "best_plan", "best_plan_for",
                     "list_studies", "pareto_front", "read_trial", "study_trials"], "planner.study.queries"),
    **dict.fromkeys(["JobVerdict", "Recommendation", "confirmation_history", "job_verdicts", "recommend"],
                    "planner.study.recommendation"),
    "SearchSpace": "planner.study.search_space",
    **dict.fromkeys(["SIM_METRICS", "SIM_SUFFIX", "complete_trials", "simulated_stage", "smallest_peak"],
                    "planner.study.simulated"),
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
