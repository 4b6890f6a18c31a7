"""Predicted plans: the best plan for a cluster not yet measured (``tune --target``), kept apart from the study's
measured trials.

[Note: Predicted plans are raced, never recommended]
A plan predicted for a target rests on the simulator alone, with the band
its figures allow (``planner.simulation.band``). It is written with
provenance ``predicted`` and stored as a trial of study ``NAME.predicted``,
never of ``NAME``: the study's recommendation (``planner.study.queries``)
and ``load_best_plan`` read ``NAME`` only, so no prediction is ever handed
over as a measured result. On the real cluster the in-loop tuner
(``runtime.AutoTuner(..., start_from="plan.json")``, or on the same study)
races it first among its candidates, against FSDP2's default on the user's
own steps: it is confirmed there, or dropped, like any candidate.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import optuna

from planner.artifacts.config import StudyConfig
from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.memory_budget import NCCL_COMMUNICATOR_BYTES, PeakBudget
from planner.artifacts.plan import Plan, Source
from planner.errors import MemoryBudgetError, PlannerError, TargetError
from planner.simulation.what_if import Scenario
from planner.study.search_space import SearchSpace

logger = logging.getLogger(__name__)

PREDICTED_SUFFIX = ".predicted"


@dataclass(frozen=True)
class PredictedPlan:
    """One plan predicted for a target.

    Attributes:
        plan: the plan (provenance ``predicted``: the target, the predicted step and its band, the parameters).
        default_ms: FSDP2's default predicted on the target, ms.
        default_band_ms: its band, ``(low, high)`` ms.
        band_dominant: which part of the plan's band moves it most (``"fit"``, ``"link"``, ``"rank skew"``).
        trials: the simulated trials searched.
        distributions: its parameters' Optuna distributions (the simulated trial's).
    """

    plan: Plan
    default_ms: float
    default_band_ms: tuple[float, float]
    band_dominant: str
    trials: int
    distributions: dict[str, optuna.distributions.BaseDistribution]

    @property
    def ratio(self) -> float:
        """The plan's predicted step over FSDP2's default's, on the target."""
        return self.plan.provenance.predicted_ms / self.default_ms


def predict_for_target(config: StudyConfig, scenario: Scenario, space: SearchSpace,
                       progress: bool = False) -> PredictedPlan:
    """The simulated stage on a what-if's re-targeted profile, in memory; its best plan within the memory budget.

    Args:
        config: the study (``[search]``: trials, sampler, memory budget).
        scenario: the recorded profile at its full depth on the target
            (:meth:`planner.simulation.what_if.WhatIf.apply`, or ``Scenario.of``); it must have a target.
        space: the search space.
        progress: Optuna's progress bar.

    Raises:
        TargetError: ``scenario`` has no target.
        MemoryBudgetError: a relative budget (nothing measured on the target to be relative to), or one below
            every plan's predicted peak.
    """
    from planner.study.candidates import distinct_plans
    from planner.study.records import SimulatedTrialRecord
    from planner.study.simulated import simulated_stage

    target = scenario.target
    if target is None:
        raise TargetError("a prediction for a target needs one: pass --target (a preset or a target TOML)")
    there = scenario.simulated
    simulator = scenario.simulator()
    budget = config.search.budget()
    limit, charged = None, None
    if budget is not None:
        if budget.relative:
            raise MemoryBudgetError(f"memory_budget {budget.text!r} is relative to FSDP2's default's measured peak, "
                                    "which is not measured on a target; give an absolute budget, e.g. '70GiB'")
        limit = budget.resolve(None)
        nccl = NCCL_COMMUNICATOR_BYTES if there.fingerprint.device_type == "cuda" else 0
        charged = PeakBudget(limit, communicator_bytes=nccl)
    sim = simulated_stage(simulator, config, optuna.storages.InMemoryStorage(), space, show_progress_bar=progress,
                          budget=charged)
    default = Plan.default(there)
    default_result = simulator.run(default)
    best = None
    for trial, plan in distinct_plans(sim, there, space):
        if charged is None or charged.admits(plan, SimulatedTrialRecord.from_trial(trial).predicted_peak_bytes or 0):
            best = (trial, plan)
            break
    if best is None:
        raise MemoryBudgetError(f"no plan predicted for the target fits the memory budget {budget.text}; raise it")
    trial, plan = best
    result = simulator.run(plan)
    if result.step_ms >= default_result.step_ms:  # nothing beats the default on the target: say so, hand it over
        trial, plan, result = None, default, default_result
    band, default_band = scenario.band(plan), scenario.band(default)
    with_provenance = plan.with_provenance(
        source=Source.PREDICTED, study=config.name, predicted_ms=result.step_ms,
        predicted_peak_bytes=result.peak_bytes, memory_budget_bytes=limit, target=target.describe(),
        band_ms=(band.low_ms, band.high_ms), params=dict(trial.params) if trial is not None else {})
    return PredictedPlan(with_provenance, default_result.step_ms, (default_band.low_ms, default_band.high_ms),
                         band.dominant.name, len(sim.trials), dict(trial.distributions) if trial is not None else {})


def store_predicted(storage_url: str, name: str, predicted: PredictedPlan) -> int:
    """Store a predicted plan as a COMPLETE trial of study ``NAME.predicted`` (value: its predicted step, ms); its
    trial number.

    Raises:
        StorageError: the storage cannot be opened or written.
    """
    from planner.storages import open_storage, storage_errors

    plan = predicted.plan
    pv = plan.provenance
    storage = open_storage(storage_url)
    with storage_errors(storage_url):
        study = optuna.create_study(study_name=name + PREDICTED_SUFFIX, storage=storage, direction="minimize",
                                    load_if_exists=True)
        trial = optuna.trial.create_trial(
            params=pv.params or {}, distributions=predicted.distributions, value=pv.predicted_ms,
            user_attrs={"target": pv.target, "band_ms": list(pv.band_ms), "default_ms": predicted.default_ms,
                        "default_band_ms": list(predicted.default_band_ms), "band_dominant": predicted.band_dominant,
                        "predicted_peak_bytes": pv.predicted_peak_bytes, "plan": json.dumps(plan.to_dict())})
        study.add_trial(trial)
        return len(study.trials) - 1


@dataclass(frozen=True)
class PredictedRecord:
    """A predicted plan as its study stores it.

    Attributes:
        number: its trial in ``NAME.predicted``.
        plan: the plan.
        default_ms: FSDP2's default predicted on the same target, ms.
        band_dominant: which part of the band moves it most.
    """

    number: int
    plan: Plan
    default_ms: float
    band_dominant: str


def predicted_plans(storage_url: str, name: str) -> list[PredictedRecord]:
    """Every plan predicted for study ``name``, oldest first; empty when there is none (or no database).

    Raises:
        StorageError: the storage cannot be opened.
    """
    from planner.errors import StudyNotFoundError
    from planner.storages import open_storage_read_only

    try:
        storage = open_storage_read_only(storage_url)
    except StudyNotFoundError:
        return []
    try:
        study = optuna.load_study(study_name=name + PREDICTED_SUFFIX, storage=storage)
    except KeyError:
        return []
    finally:
        storage.engine.dispose()
    out = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        try:
            plan = Plan.from_dict(json.loads(t.user_attrs["plan"]))
        except (KeyError, ValueError, PlannerError):
            continue  # a trial written by hand: not a predicted plan
        out.append(PredictedRecord(t.number, plan, t.user_attrs.get("default_ms", float("nan")),
                                   t.user_attrs.get("band_dominant", "")))
    return out


def predicted_for(storage_url: str, name: str, fingerprint: Fingerprint) -> Plan | None:
    """The latest plan predicted for this model in study ``name`` (any world size: it was predicted for a
    target); ``None`` when there is none."""
    plans = [r.plan for r in predicted_plans(storage_url, name)
             if r.plan.fingerprint.model_difference(fingerprint) is None]
    return plans[-1] if plans else None
