"""The candidates of the measured stage: which simulated plans are worth racing against the baseline.

[Note: Candidates worth racing]
The race can only confirm what it is given, and the model before any fit ties
plans that behave differently on the ranks. So the candidates are: the best plan
of the uniform grid (FSDP2's usual hand-set knobs), always, so a per-module
plan has to beat it on the real ranks; then, among plans predicted within
``band_pct`` of the best, one plan per kind (the same knobs and the same
predicted timeline make near-copies the model cannot tell apart), the one
with the lowest predicted peak memory; then the next best by prediction.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import optuna

from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.memory_budget import PeakBudget
from planner.artifacts.plan import Plan, baseline_name
from planner.artifacts.profile import Profile
from planner.study.records import SimulatedTrialRecord
from planner.study.search_space import SearchSpace, TrialParams
from planner.study.simulated import complete_trials

if TYPE_CHECKING:
    from planner.study.earlier_jobs import EarlierJobs
    from planner.study.measured import MeasuredTrial

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    """A plan chosen for the measured stage, with its simulated trial's parameters.

    Attributes:
        params, distributions: the simulated trial's, so the measured trial
            carries the same parameters (optuna-dashboard compares them).
        plan: the plan they build for the profile.
        predicted_ms: the simulated step time, ms.
        predicted_peak_bytes: the simulated peak memory, bytes.
        reconfirms: for the study's recommendation raced again, the trial that recommended it.
        predicted_for: for a plan predicted for this cluster (``tune --target``), the target it was predicted for.
        user_plan: the plan the model arrived with (``runtime.current_plan``), raced as the round's baseline: it
            has no search-space parameters.
    """

    params: TrialParams
    distributions: dict[str, optuna.distributions.BaseDistribution]
    plan: Plan
    predicted_ms: float
    predicted_peak_bytes: int
    reconfirms: int | None = None
    predicted_for: str | None = None
    user_plan: bool = False


def candidate(plan: Plan, simulator: Any = None, params: TrialParams | None = None,
              distributions: dict[str, optuna.distributions.BaseDistribution] | None = None, *,
              prediction: tuple[float, int] | None = None, budget: PeakBudget | None = None,
              **marks: Any) -> Candidate | None:
    """The one way a :class:`Candidate` is made: ``plan`` with its predicted step and peak, the search-space
    parameters it was built from (none: the plan the model arrived with), and ``marks`` (``reconfirms``,
    ``predicted_for``, ``user_plan``).

    Args:
        simulator: predicts the plan (``Simulator.run``: step ms, peak bytes) where ``prediction`` is not given.
        prediction: ``(step ms, peak bytes)`` a simulated trial predicted already.
        budget: the memory budget: a plan it does not admit at its predicted peak is no candidate (``None``;
            :meth:`~planner.artifacts.memory_budget.PeakBudget.admits`); ``None``: no budget.
    """
    if prediction is None:
        result = simulator.run(plan)
        prediction = (result.step_ms, result.peak_bytes)
    step_ms, peak_bytes = prediction
    if budget is not None and not budget.admits(plan, peak_bytes):
        return None
    return Candidate(dict(params or {}), dict(distributions or {}), plan, step_ms, peak_bytes, **marks)


def trial_candidate(trial: optuna.trial.FrozenTrial, profile: Profile, space: SearchSpace, simulator: Any, *,
                    budget: PeakBudget | None = None, **marks: Any) -> Candidate | None:
    """A trial's plan, rebuilt from its parameters for ``profile``, as a :func:`candidate` (``None``: over
    ``budget``).

    Raises:
        SpaceParamsError: its parameters build no plan in ``space`` for this profile.
    """
    plan = space.build(trial.params, profile)
    return candidate(plan, simulator, trial.params, trial.distributions, budget=budget, **marks)


# [Note: The round's candidates in order]
# A round's plans, each once, in this order (a plan met twice keeps its first
# place): the user's plan (the baseline, where the model arrived with one);
# FSDP2's default (the baseline otherwise, and raced as a candidate against a
# user's plan; left out when a re-queued trial measures it); the plan predicted
# for this cluster (``start_from``, ``tune --target``: the plan the user asked to
# race); the study's recommendation, raced again (``MeasuredStage.recommended``);
# the plans a stopped job left unmeasured (``MeasuredStage.interrupted``); then
# the simulated stage's picks ([Note: Candidates worth racing]). Re-queued plans
# of dead jobs come as trials already (``MeasuredStage.claim_retries``).


def in_round_order(default: Candidate | None, simulated: list[Candidate], *, user: Candidate | None = None,
                   predicted: Candidate | None = None, recommended: Candidate | None = None,
                   resumed: list[Candidate] | None = None, default_retried: bool = False) -> list[Candidate]:
    """The round's candidates in the order of [Note: The round's candidates in order], each plan once.

    Args:
        default: FSDP2's default as the simulated stage predicted it (``None``: it has no trial there).
        simulated: the simulated stage's picks (:func:`select_candidates` without the default).
        default_retried: a re-queued trial measures FSDP2's default: it is not asked again.
    """
    ordered = [user, None if default_retried else default, predicted, recommended, *(resumed or []), *simulated]
    seen: set[str] = set()
    out = []
    for c in ordered:
        if c is not None and plan_key(c.plan) not in seen:
            seen.add(plan_key(c.plan))
            out.append(c)
    return out


def round_candidates(earlier: EarlierJobs, sim_study: optuna.Study, budget: PeakBudget | None,
                     retries: list[MeasuredTrial], *,
                     user_plan: Plan | None = None, start_from: Plan | None = None) -> list[Candidate]:
    """A job's candidates in the order of [Note: The round's candidates in order], the re-queued ``retries`` (trials
    already) aside: the plans a stopped job left unmeasured first within ``[search] measured_trials``, then the
    simulated stage's picks ([Note: Candidates worth racing]), the study's recommendation raced again, the plan
    predicted for this cluster (``start_from``) and the plan the model arrived with (``user_plan``); none
    over ``budget`` (:func:`candidate`) but the user's, the baseline.

    Raises:
        PlanMismatchError: ``user_plan`` or ``start_from`` is not a plan of this model (or ``start_from`` has no
            search-space parameters).
        StorageError: the study cannot be read.
    """
    stage = earlier.stage
    profile, space, config = stage.profile, stage.space, stage.config
    settled = earlier.settled_keys()
    resumed = earlier.interrupted(settled, budget)[:config.search.measured_trials]  # the round's slots first
    if resumed:
        logger.info(f"      resuming: {len(resumed)} plan(s) of interrupted trials race again")
    picks = select_candidates(sim_study, profile, space, config.search.measured_trials - len(resumed),
                              exclude=settled | {plan_key(c.plan) for c in resumed},
                              band_pct=config.search.candidate_band_pct, budget=budget)
    default = next((c for c in picks if c.plan.is_default_for(profile)), None)
    recommended = earlier.recommended(budget)
    if recommended is not None:
        logger.info(f"      trial {recommended.reconfirms}'s plan (the study's recommendation, or its provisional "
                    "plan) races again: it is applied only if this job confirms it (or a plan that beats it) "
                    "faster across processes")
    predicted = None
    if start_from is not None:
        predicted = predicted_candidate(start_from, profile, space, stage.simulator)
        logger.info(f"      the predicted plan ({predicted.predicted_for}) races first: kept only if it is "
                    f"confirmed faster than {baseline_name(user_plan is not None)} here")
    user = None if user_plan is None else user_candidate(user_plan, profile, stage.simulator)
    return in_round_order(default, [c for c in picks if c is not default], user=user, predicted=predicted,
                          recommended=recommended, resumed=resumed,
                          default_retried=any(r.plan.is_default_for(profile) for r in retries))


def user_candidate(plan: Plan, profile: Profile, simulator: Any) -> Candidate:
    """The plan the model arrived with as the round's baseline ([Note: The user's plan is the baseline] in
    ``planner.study.session``), predicted by ``simulator``.

    Raises:
        PlanMismatchError: the plan is of another model or world size, or names modules the profile does not have.
    """
    from planner.errors import PlanMismatchError

    difference = plan.fingerprint.first_difference(profile.fingerprint)
    unknown = sorted(set(plan.modules) - set(profile.modules))
    if difference is not None or unknown:
        raise PlanMismatchError("the plan the model arrived with is not of the profile's model: "
                                + (difference or f"modules {', '.join(unknown[:3])} are not in its post-forward order"))
    return candidate(plan, simulator, user_plan=True)


def check_start_plan(plan: Plan, fingerprint: Fingerprint, what: str = "start_from plan") -> None:
    """A plan to race first on a cluster: of this model (any world size: it was predicted for a target), with the
    search-space parameters ``tune --target`` writes, so a tuner can race it as a trial of its study.

    Raises:
        PlanMismatchError: a plan of another model, or one without search-space parameters.
    """
    from planner.errors import PlanMismatchError

    difference = plan.fingerprint.model_difference(fingerprint)
    if difference is not None:
        raise PlanMismatchError(f"{what} is a plan of another model: {difference}; predict one for this model "
                                "(tune --target)")
    if plan.provenance.params is None:
        raise PlanMismatchError(f"{what} carries no search-space parameters (provenance 'params'): give a plan "
                                "written by `prefetch-planner tune --target`")


def predicted_candidate(plan: Plan, profile: Profile, space: SearchSpace, simulator: Any) -> Candidate:
    """A plan of provenance ``predicted`` (``tune --target``) as a candidate on ``profile``: rebuilt from its
    search-space parameters for this profile's modules, predicted by ``simulator`` (this cluster's).

    Raises:
        PlanMismatchError: the plan is of another model, or carries no search-space parameters (a plan not made by
            ``tune --target``), or parameters ``space`` cannot build.
    """
    from planner.errors import PlanMismatchError, SpaceParamsError

    check_start_plan(plan, profile.fingerprint)
    params = plan.provenance.params
    try:
        built = space.build(params, profile)
    except SpaceParamsError as e:
        raise PlanMismatchError(f"start_from plan's parameters do not build a plan in this study's space ({e}); "
                                "predict it with this study's TOML (tune --target)") from None
    return candidate(built, simulator, params, space.distributions(params, profile),
                     predicted_for=plan.provenance.target or "a predicted plan")


def plan_key(plan: Plan) -> str:
    """A short digest of :meth:`Plan.behaviour_key`, stored as trial attribute ``plan_key``."""
    return hashlib.sha1(plan.behaviour_key().encode()).hexdigest()[:16]


def distinct_plans(sim_study: optuna.Study, profile: Profile, space: SearchSpace
                   ) -> list[tuple[optuna.trial.FrozenTrial, Plan]]:
    """The study's COMPLETE trials and plans, one per behaviour (:meth:`Plan.behaviour_key`), best predicted first."""
    seen: set[str] = set()
    out = []
    for t in sorted(complete_trials(sim_study), key=lambda t: (t.values[0], t.number)):
        plan = space.build(t.params, profile)
        if plan.behaviour_key() not in seen:
            seen.add(plan.behaviour_key())
            out.append((t, plan))
    return out


def select_candidates(
    sim_study: optuna.Study,
    profile: Profile,
    space: SearchSpace,
    k: int,
    exclude: frozenset[str] | set[str] = frozenset(),
    band_pct: float = 5.0,
    budget: PeakBudget | None = None,
) -> list[Candidate]:
    """FSDP2's default followed by up to ``k`` simulated plans worth racing ([Note: Candidates worth racing]).

    Plans whose :func:`plan_key` is in ``exclude`` (measured already, being
    measured by another job, or failed on a rank) are skipped; the default
    never is: it is every job's baseline.

    Args:
        band_pct: plans predicted within this many % of the best are "as good
            as the model can tell"; among them the selection prefers plans
            that differ in what they do.
        budget: only plans it admits at their predicted peak are candidates (:func:`candidate`); ``None``: no
            budget.
    """
    grid = space.uniform_grid(profile)  # the hand-set baseline: uniform knobs only
    ranked = distinct_plans(sim_study, profile, space)
    default = next(((t, p) for t, p in ranked if p.is_default_for(profile)), None)
    rest = [(t, p) for t, p in ranked if not p.is_default_for(profile) and plan_key(p) not in exclude
            and (budget is None or budget.admits(p, _peak(t)))]
    chosen: list[tuple[optuna.trial.FrozenTrial, Plan]] = []
    uniform = [(t, p) for t, p in rest if t.params in grid]
    if uniform and k > 0:
        chosen.append(uniform[0])  # the best uniform plan: a per-module plan must beat it on the ranks
    if rest:
        best_ms = rest[0][0].values[0]
        kinds: dict[tuple, list[tuple[optuna.trial.FrozenTrial, Plan]]] = {}
        for t, p in rest:
            if t.values[0] <= best_ms * (1.0 + band_pct / 100.0):
                kinds.setdefault(_what_it_does(t, p, best_ms), []).append((t, p))
        # One plan per kind: the lowest predicted peak, then the faster, then the earlier trial.
        picks = [min(g, key=lambda tp: (_peak(tp[0]), tp[0].values[0], tp[0].number))
                 for g in kinds.values()]
        taken = {_what_it_does(t, p, best_ms) for t, p in chosen}
        for t, p in sorted(picks, key=lambda tp: (tp[0].values[0], _peak(tp[0]), tp[0].number)):
            if len(chosen) < k and _what_it_does(t, p, best_ms) not in taken:
                chosen.append((t, p))
                taken.add(_what_it_does(t, p, best_ms))
        for t, p in rest:  # fewer kinds than slots: the next best by prediction
            if len(chosen) < k and all(t is not c for c, _ in chosen):
                chosen.append((t, p))
    return [candidate(p, params=t.params, distributions=t.distributions, prediction=(t.values[0], _peak(t)))
            for t, p in ([default] if default else []) + chosen[:k]]


def _what_it_does(trial: optuna.trial.FrozenTrial, plan: Plan, best_ms: float) -> tuple:
    """Plans alike here are near-copies the model cannot tell apart: the same knobs and the same predicted step."""
    kept = frozenset(f for f, m in plan.modules.items() if not m.reshard_after_forward)
    return (plan.knobs, kept,
            round(trial.values[0] / best_ms, 3),
            round((SimulatedTrialRecord.from_trial(trial).exposed_comm_ms or 0.0) / max(best_ms, 1e-9), 3))


def _peak(trial: optuna.trial.FrozenTrial) -> int:
    """A simulated trial's predicted peak, bytes per rank."""
    return SimulatedTrialRecord.from_trial(trial).predicted_peak_bytes or 0
