"""The in-loop tuner's decisions, torch-free: its phases, the study it writes, and what it does at construction.

``runtime.AutoTuner`` tunes inside a user's own training loop, on the real
steps. It runs the same tuning session as ``prefetch-planner tune``
(:class:`planner.study.session.TuningSession`): the same simulated stage,
candidates, race, confirmation and recommendation. What differs is who runs
the steps (the user's loop, one ``with tuner.step():`` per optimizer step) and
where the confirmation runs (in the loop: ``confirm_launches = 0``).

[Note: Tuning on the user's steps]
Every plan leaves the loss bitwise identical to FSDP2's default (the loss
property test, ``tests/test_loss_equivalence.py``), so racing plans on the
user's own steps costs time, never correctness: the bargain
``torch.backends.cudnn.benchmark`` makes. Three things could still change
the training, and the tuner keeps them out:
- the recorder's isolated passes (every module unsharded, or a few at a
  time under the memory budget, gradient sync off) run between steps on
  the first step's inputs, with a surrogate loss
  (the sum of the outputs); their gradients are cleared, never reduced into
  the user's, and the random-number generators and the model's buffers
  (batch-norm statistics) are restored after them;
- the overlap microbenchmark draws random matrices: restored likewise;
- a plan is switched only between steps, on every rank at the same step.

The first run gains: a survivor faster on this process's fresh rounds is
applied for the rest of the process and watched ([Note: Applied in the
process that measured it] and [Note: The watch] in
``planner.statistics.watch``), while the study keeps it provisional until
fresh launches confirm it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.artifacts.config import StudyConfig
from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.plan import Plan
from planner.artifacts.profile import Profile
from planner.errors import StudyConfigError, StudyModelMismatchError
from planner.statistics.looks import MAX_LAUNCHES
from planner.statistics.watch import WatchState

SOURCE = "in-loop"  # trial attribute ``source`` of the trials the in-loop tuner measures
FACTORY = "<in-loop>"  # [workload] factory of an in-loop study: the user's loop builds the model, no factory
# A 10 s cap on the simulated stage; the confirmation in the loop, on 16 rounds or more: this process's fresh rounds
# decide whether the survivor runs for the rest of it ([Note: Applied in the process that measured it] in
# planner.statistics.watch), and fewer see too few of a stalling plan's slow steps.
IN_LOOP_DEFAULTS: dict[str, Any] = {"sim_timeout_s": 10.0, "confirm_launches": 0, "confirm_min_rounds": 16}


class TunerPhase(enum.StrEnum):
    """Where an in-loop tuner is (``runtime.AutoTuner.phase``).

    Attributes:
        RECORDING: FSDP2's default runs; the profile is recorded on its steps (isolated passes between steps).
        SEARCHING: the simulated stage and the candidates (between two steps, on rank 0).
        RACING: one plan per step, in the race's balanced order (their warm-up steps first).
        CONFIRMING: the race's survivor against FSDP2's default on fresh rounds.
        WATCHING: the survivor, faster on this process's fresh rounds but not yet across processes, applied for the
            rest of the process, two steps in each block of K running FSDP2's default ([Note: The watch] in
            ``planner.statistics.watch``); reverted to the default if it is slower in total.
        DONE: the recommended plan (or FSDP2's default) stays applied; the tuner adds nothing to a step.
    """

    RECORDING = "recording"
    SEARCHING = "searching"
    RACING = "racing"
    CONFIRMING = "confirming"
    WATCHING = "watching"
    DONE = "done"


def in_loop_config(study: str, storage: str | None = None, memory_budget: str | None = None,
                   directory: str | Path = ".", **keys: Any) -> StudyConfig:
    """The study an in-loop tuner runs, from the :class:`~runtime.AutoTuner` arguments.

    Args:
        study: the study's name (``[study] name``).
        storage: its SQLAlchemy URL; ``None``: the caller gives a private SQLite file.
        memory_budget: ``[search] memory_budget`` (``"+10%"``, ``"1.5GiB"``, ...).
        directory: where relative outputs go.
        keys: any other study key, flat (``sim_trials=400``, ``min_rounds=6``, ...: the TOML keys). The
            in-loop defaults (:data:`IN_LOOP_DEFAULTS`) apply where not given: a 10 s cap on the simulated
            stage, and the confirmation in the loop on 16 rounds or more.

    Raises:
        StudyConfigError: an unknown key, a value out of range, or ``confirm_launches`` other than 0 (the
            confirmation runs in the loop: the tuner cannot start processes).
    """
    if keys.get("confirm_launches", 0) != 0:
        raise StudyConfigError(f"AutoTuner: confirm_launches = {keys['confirm_launches']}, but in the training loop "
                               "the confirmation runs on the loop's own steps; leave confirm_launches unset (0)")
    if "factory" in keys:
        raise StudyConfigError("AutoTuner: 'factory' is not a key here: the training loop builds the model")
    fields = {**IN_LOOP_DEFAULTS, **keys, "name": study, "factory": FACTORY, "memory_budget": memory_budget,
              "storage": storage}
    high = keys.get("confirm_max_rounds")
    if "confirm_min_rounds" not in keys and isinstance(high, int) and high < IN_LOOP_DEFAULTS["confirm_min_rounds"]:
        fields["confirm_min_rounds"] = max(6, high)  # the in-loop default gives way to a smaller maximum asked for
    return StudyConfig.build(directory, source="AutoTuner", **fields)


@dataclass(frozen=True)
class StartDecision:
    """What an in-loop tuner does at construction (:func:`start_decision`).

    Attributes:
        tune: tune on the coming steps (else apply the study's recommendation and spend no step).
        why: one line for the log.
        recheck: tune by racing the study's recommendation against FSDP2's default only, on the study's stored
            profile: no recording, no simulated trial, no new candidate (:func:`recheck_config`).
    """

    tune: bool
    why: str
    recheck: bool = False


def same_model(a: Fingerprint, b: Fingerprint) -> bool:
    """The same FSDP modules with the same parameter counts (whatever the world size, device or torch)."""
    return a.module_fqns == b.module_fqns and a.param_numels == b.param_numels


def same_job(a: Fingerprint, b: Fingerprint) -> bool:
    """What a plan and its measurements are good for: the same model on the same world size, device, dtypes and
    torch version."""
    return same_model(a, b) and (a.world_size, a.mesh, a.tensor_parallel, a.device_type, a.param_dtypes,
                                 a.torch_version) == (b.world_size, b.mesh, b.tensor_parallel, b.device_type,
                                                      b.param_dtypes, b.torch_version)


def start_decision(study: str, fingerprint: Fingerprint, stored: Sequence[Fingerprint], has_recommendation: bool,
                   recheck: bool, recommends_baseline: bool = False,
                   launches_behind: int | None = None) -> StartDecision:
    """Tune, or reuse the study's recommendation ([Note: Tuning on the user's steps]).

    A recheck of a recommended plan re-confirms it on a few steps (:attr:`StartDecision.recheck`); a recheck of a
    study that recommends its baseline (FSDP2's default, or the plan the model arrived with) has nothing to
    re-confirm, so it tunes afresh. A pending plan (provisional, [Note: Provisional verdicts] in
    ``planner.statistics.verdict``) is re-confirmed at every start, recheck or not, the baseline applied meanwhile:
    each start is a fresh process, one more fresh launch.

    Args:
        study: the study's name (for the messages).
        fingerprint: the model at hand.
        stored: the fingerprints of the study's recorded profiles (``planner.storages.archive.study_fingerprints``).
        has_recommendation: the study has a concluded job for ``fingerprint`` (``planner.study.best_plan_for``).
        recheck: the user asked to re-confirm the recommendation on the coming steps.
        recommends_baseline: the recommendation is its deciding job's baseline (nothing confirmed faster).
        launches_behind: when the study has a pending plan, the fresh launches it rests on; else ``None``.

    Raises:
        StudyModelMismatchError: every stored profile is of another model (other FSDP modules or parameter
            counts): the study's trials would be mixed up with this model's; name a new study.
    """
    if stored and not any(same_model(s, fingerprint) for s in stored):
        difference = stored[-1].first_difference(
            Fingerprint(fingerprint.module_fqns, fingerprint.param_numels, fingerprint.param_bytes,
                        stored[-1].world_size, fingerprint.device_type, fingerprint.param_dtypes,
                        fingerprint.torch_version))
        raise StudyModelMismatchError(
            f"study {study!r} was tuned for another model ({difference}); give this model its own study name")
    if has_recommendation and any(same_job(s, fingerprint) for s in stored):
        if launches_behind is not None:
            return StartDecision(True, f"study {study!r} has a provisional plan (faster in its launches, not yet "
                                       f"across processes; {launches_behind} fresh launch(es) so far): the "
                                       "baseline stays applied while the coming steps re-confirm it, fresh launch "
                                       f"{launches_behind + 1} of up to {MAX_LAUNCHES}", recheck=True)
        if recheck and recommends_baseline:
            return StartDecision(True, f"study {study!r} recommends the baseline for this model; recheck=True: "
                                       "tuning afresh on the coming steps")
        if recheck:
            return StartDecision(True, f"study {study!r} has a plan for this model; recheck=True: re-confirming it "
                                       "against the baseline on the coming steps (no recording, no search)",
                                 recheck=True)
        return StartDecision(False, f"study {study!r} has a plan for this model, world size and torch: applied, "
                                    "no step spent tuning")
    if not stored:
        return StartDecision(True, f"study {study!r} is new: tuning on the coming steps")
    if any(same_job(s, fingerprint) for s in stored):
        return StartDecision(True, f"study {study!r} has no concluded job for this model yet: tuning on the "
                                   "coming steps")
    last = stored[-1]
    changed = [f"{name} {old} -> {new}" for name, old, new in (
        ("world size", last.world_size, fingerprint.world_size), ("mesh", last.mesh_text, fingerprint.mesh_text),
        ("device", last.device_type, fingerprint.device_type),
        ("dtypes", ",".join(last.param_dtypes), ",".join(fingerprint.param_dtypes)),
        ("torch", last.torch_version, fingerprint.torch_version)) if old != new]
    return StartDecision(True, f"study {study!r} was tuned for this model on another setup ({'; '.join(changed)}): "
                               "tuning afresh")


def step_orders(block: Sequence[Sequence[int]]) -> list[int]:
    """A schedule block (per round, plan indices in running order) as the plan of each step, in order."""
    return [plan for order in block for plan in order]


def block_times(block: Sequence[Sequence[int]], step_ms: Sequence[float]) -> list[dict[int, float]]:
    """The block's step times in the form ``Schedule.record`` takes: per round, plan index -> ms.

    Args:
        block: the block as handed out.
        step_ms: each of its steps' time (max across ranks), in :func:`step_orders` order.

    Raises:
        ValueError: ``step_ms`` does not have one time per step of the block.
    """
    if len(step_ms) != sum(len(order) for order in block):
        raise ValueError(f"{len(step_ms)} step times for a block of {sum(len(o) for o in block)} steps")
    out, i = [], 0
    for order in block:
        out.append({plan: step_ms[i + k] for k, plan in enumerate(order)})
        i += len(order)
    return out


def recheck_config(config: StudyConfig) -> StudyConfig:
    """The study as a recheck runs it: no simulated trial and no new candidate, so the round is FSDP2's default and
    the study's recommendation, which every job races again (``planner.study.session``)."""
    search = config.search.model_copy(update={"sim_trials": 0, "measured_trials": 0})
    return config.model_copy(update={"search": search})


@dataclass(frozen=True)
class StartPlan:
    """What :func:`plan_at_start` read: the decision, the plan to apply and the profile a recheck runs on.

    Attributes:
        decision: tune or reuse.
        plan: the study's recommended plan to apply when ``decision.tune`` is false (``None``: FSDP2's default is
            the recommendation, or the tuner tunes).
        profile: with ``decision.recheck``: the study's latest stored profile of this job (same model, world size,
            device and torch), which the recheck's session runs on; else ``None``.
    """

    decision: StartDecision
    plan: Plan | None = None
    profile: Profile | None = None


def study_profiles(config: StudyConfig) -> list[Profile] | None:
    """Every profile study ``config.name`` stores, oldest first, read-only; ``None`` when there is no database yet,
    empty when no tuning job has written its tables.

    Raises:
        StorageError: the storage cannot be opened.
    """
    import sqlalchemy as sa

    from planner.errors import StudyNotFoundError
    from planner.storages import open_storage_read_only
    from planner.storages.archive import stored_profiles

    try:
        storage = open_storage_read_only(config.storage_url)
    except StudyNotFoundError:
        return None
    try:
        return stored_profiles(storage.engine, config.name)
    except sa.exc.SQLAlchemyError:  # a database no tuning job has written: no planner tables yet
        return []
    finally:
        storage.engine.dispose()


def plan_at_start(config: StudyConfig, fingerprint: Fingerprint, recheck: bool = False) -> StartPlan:
    """Read the study (nothing is written) and decide what an in-loop tuner does at construction.

    Raises:
        StudyModelMismatchError: the study was tuned for another model (:func:`start_decision`).
        StorageError: the storage cannot be opened.
    """
    from planner.errors import StudyNotFoundError
    from planner.study.queries import recommendation_for

    profiles = study_profiles(config)
    if profiles is None:  # no database yet
        return StartPlan(start_decision(config.name, fingerprint, [], False, recheck))
    try:
        best = recommendation_for(config.storage_url, config.name, fingerprint)
    except StudyNotFoundError:
        best = None
    behind = None
    if best is not None and best.recommendation.pending is not None:
        behind = best.recommendation.pending.confirmation.fresh_launches
    decision = start_decision(config.name, fingerprint, [p.fingerprint for p in profiles], best is not None,
                              recheck, recommends_baseline=best is not None and best.keeps_baseline,
                              launches_behind=behind)
    if decision.recheck:
        return StartPlan(decision, profile=[p for p in profiles if same_job(p.fingerprint, fingerprint)][-1])
    if decision.tune or best is None or best.keeps_baseline:
        return StartPlan(decision)
    return StartPlan(decision, best.plan)


def predicted_start(path: str, fingerprint: Fingerprint) -> Plan:
    """The ``start_from`` plan of an in-loop tuner: a plan of this model (any world size) with the search-space
    parameters ``tune --target`` writes ([Note: Predicted plans are raced, never recommended] in
    ``planner.study.predicted``).

    Raises:
        PlanFormatError: the file cannot be read as a plan.
        PlanMismatchError: a plan of another model, or one without search-space parameters.
    """
    from planner.study.candidates import check_start_plan

    plan = Plan.load(path)
    check_start_plan(plan, fingerprint, f"start_from {path!r}")
    return plan


def record_watch(config: StudyConfig, trial: int, job: str, state: WatchState) -> None:
    """Store where the watch of ``trial``'s plan stands in the study (``planner_watches``).

    Raises:
        StorageError: the storage cannot be written.
    """
    from planner.storages import open_storage, storage_errors
    from planner.storages.archive import save_watch_row

    with storage_errors(config.storage_url):
        storage = open_storage(config.storage_url)
        try:
            save_watch_row(storage.engine, config.name, trial, job, state.steps, state.blocks,
                           state.ratio if state.ratio == state.ratio else None, state.statistic, state.reverted)
        finally:
            storage.engine.dispose()
