"""The measured round of the in-loop tuner: what happens between the user's steps, on every rank together.

The rank protocol of ``runtime.measuring.protocol`` ([Note: Rank protocol of a measured
round]) turned inside out: there, the protocol runs the steps; here, the
user's loop runs them (``runtime.in_loop.autotuner``) and this round is called between
two of them. It answers each call with the steps to run next, as
:class:`LoopStep` s, until the schedule is done. Rank 0 alone holds the tuning
session (``planner.study.session.TuningSession``) and decides; every exchange
between ranks is a collective on the control group.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from planner import errors
from planner.artifacts.config import StudyConfig
from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.plan import Plan, baseline_name
from planner.artifacts.profile import Profile
from planner.errors import FailKind, PlannerError, one_line
from planner.statistics.schedule import Phase
from planner.statistics.verdict import Confirmation
from planner.statistics.watch import InProcess, in_process
from planner.storages import check_writable
from planner.study.in_loop import (
    SOURCE,
    StartDecision,
    block_times,
    plan_at_start,
    predicted_start,
    recheck_config,
    step_orders,
)
from planner.study.predicted import predicted_for
from planner.study.records import confirmation_attrs, confirmation_from
from runtime.apply import apply_plan
from runtime.ranks.collectives import broadcast_from_rank0, gather_objects, max_across_ranks
from runtime.recording.peak_memory import PEAK_STEPS, peak_of_steps
from search_spaces.session import open_session, optuna_quiet

logger = logging.getLogger("runtime.in_loop.autotuner")

# What a tuner step does: RECORD_WARMUP and WARMUP are untimed, RECORD and TIMED timed, the PEAK kinds measure
# peak memory (untimed).
RECORD_WARMUP, RECORD, RECORD_PEAK, WARMUP, PEAK, TIMED = (
    "record-warmup", "record", "record-peak", "warmup", "peak", "timed")


@dataclass(frozen=True)
class LoopStep:
    """One of the user's steps as the tuner runs it: its kind, and the plan (index into the round's plans;
    0: the baseline, FSDP2's default or the plan the model arrived with)."""

    kind: str
    plan: int


@dataclass(frozen=True)
class RoundEnd:
    """What a concluded round leaves on every rank.

    Attributes:
        plan: the plan the study recommends now (the baseline unless one is faster across processes).
        confirmation: the survivor's confirmation (``None`` when the race dropped every candidate).
        line: rank 0's line on the study's recommendation.
        survivor: the race's survivor and its trial number, ``None`` without one.
        here: what this process's confirmation rounds say of the survivor ([Note: Applied in the process that
            measured it] in ``planner.statistics.watch``); ``None`` without a survivor.
        keeps_baseline: the study recommends the round's baseline (nothing confirmed faster than it): the model
            keeps the plan it had, exactly.
    """

    plan: Plan
    confirmation: Confirmation | None
    line: str
    survivor: tuple[Plan, int] | None = None
    here: InProcess | None = None
    keeps_baseline: bool = True

    @property
    def applies_here(self) -> bool:
        """Whether the survivor runs for the rest of this process, watched: faster on this process's fresh rounds,
        and not the plan the study recommends already."""
        return (self.survivor is not None and self.here is not None and self.here.faster
                and self.survivor[0].behaviour_key() != self.plan.behaviour_key())


@dataclass(frozen=True)
class TunerStart:
    """What the tuner does at construction, decided on rank 0 and broadcast.

    Attributes:
        tune: spend steps tuning; else apply :attr:`plan_json` (or FSDP2's default) and stop.
        why: the log line that says why.
        plan_json: the study's plan for this model (Plan JSON); ``None``: none.
        recheck: a recheck's stored profile's microbatches; ``None``: no recheck.
    """

    tune: bool
    why: str
    plan_json: str | None
    recheck: int | None


class InLoopRound:
    """The round of one in-loop tuner (every rank holds one; rank 0's holds the tuning session).

    Args:
        model: the root FSDP module.
        config: the in-loop study (``planner.study.in_loop.in_loop_config``).
        group: the control group.
        files: rank 0's ``(plan_out, profile_out)`` paths the session writes; ``profile_out`` ``None``: not written.
        user_plan: the plan the model arrived with, the round's baseline ([Note: The user's plan is the baseline]
            in ``planner.study.session``); ``None``: FSDP2's default is.
    """

    def __init__(self, model: nn.Module, config: StudyConfig, group: dist.ProcessGroup,
                 files: tuple[str, str | None], user_plan: Plan | None = None):
        self.model, self.config, self.group, self.files = model, config, group, files
        self.user_plan = user_plan
        self.rank0 = dist.get_rank() == 0
        self.plans: list[Plan] = []
        self.session: Any = None
        self.asked: list[Any] = []
        self.kept: list[int] = []
        self.failed: dict[int, str] = {}
        self.peaks: list[list[int]] = []
        self.block: list[list[int]] | None = None
        self.confirming = False
        self.stored_profile: Profile | None = None
        self.start_from: Plan | None = None
        self._schedule: Any = None
        self._step_ms: list[list[float]] = []
        self._per_rank: list[list[list[float]]] = []

    def everywhere(self, compute: Callable[[], Any]) -> Any:
        """``compute()`` on rank 0, its result on every rank; a planner error there raises on every rank.

        Raises:
            PlannerError: ``compute`` raised one on rank 0 (its message).
        """
        payload: Any = None
        if self.rank0:
            try:
                payload = compute()
            except PlannerError as e:
                payload = {"error": one_line(e)}
        return broadcast_from_rank0(payload, self.group)

    def start(self, fingerprint: Fingerprint, recheck: bool, start_from: str | None = None) -> TunerStart:
        """What the tuner does at construction (``planner.study.in_loop.plan_at_start``, read on rank 0), on every
        rank; rank 0 keeps the stored profile a recheck runs on (:attr:`stored_profile`) and the predicted plan to
        race first (:attr:`start_from`: the ``start_from`` file's, else the study's latest for this model when it
        tunes afresh; ``planner.study.predicted``).

        Raises:
            PlannerError: the planner error rank 0 met (its class: ``StudyModelMismatchError``, ``StorageError``,
                ``PlanFormatError`` or ``PlanMismatchError`` for a ``start_from`` file that is no plan of this
                model's, or carries no search-space parameters).
        """
        payload: Any = None
        if self.rank0:
            try:
                begin = plan_at_start(self.config, fingerprint, recheck)
                decision = begin.decision
                if start_from is not None:
                    self.start_from = predicted_start(start_from, fingerprint)
                    if not decision.tune:  # the study has a plan: race the predicted one against it and the default
                        decision = StartDecision(True, f"{decision.why.split(':')[0]}; start_from={start_from!r}: "
                                                       "racing it against the study's plan and FSDP2's default")
                elif decision.tune and not decision.recheck:
                    self.start_from = predicted_for(self.config.storage_url, self.config.name, fingerprint)
                if self.start_from is not None and not decision.recheck:
                    decision = StartDecision(True, decision.why + f"; the plan predicted for "
                                                                  f"{self.start_from.provenance.target or 'a target'} "
                                                                  "races first")
                if decision.tune:
                    check_writable(self.config.storage_url)
                begin = dataclasses.replace(begin, decision=decision)
                payload = TunerStart(begin.decision.tune, begin.decision.why,
                                     begin.plan.to_json() if begin.plan else None,
                                     begin.profile.microbatches if begin.profile else None)
                self.stored_profile = begin.profile
            except PlannerError as e:
                payload = {"raise": type(e).__name__, "message": str(e)}
        payload = broadcast_from_rank0(payload, self.group)
        if isinstance(payload, dict):
            raise getattr(errors, payload["raise"], PlannerError)(payload["message"])
        return payload

    def search(self, profile: Profile | None, recheck: bool = False) -> list[LoopStep]:
        """The simulated stage and the candidates (rank 0), applied and checked everywhere; their warm-up steps.

        Args:
            profile: the profile the session runs on (rank 0's is used; other ranks may pass ``None``).
            recheck: no simulated trial and no new candidate: FSDP2's default and the study's recommendation only
                (``planner.study.in_loop.recheck_config``).

        Raises:
            PlannerError: the session could not ask (storage, budget), or the baseline failed to apply.
        """
        def ask() -> list[dict]:
            plan_out, profile_out = self.files
            config = recheck_config(self.config) if recheck else self.config
            self.session = open_session(config, profile, plan_out=plan_out, profile_out=profile_out or "",
                                        confirm_launches=0, source=SOURCE)
            self.session.start_from = None if recheck else self.start_from
            self.session.user_plan = self.user_plan
            self.asked = self.session.prepare()
            return [a.plan.to_dict() for a in self.asked]

        t0 = time.perf_counter()
        with optuna_quiet():  # not a line per simulated trial in the user's log
            self.plans = [Plan.from_dict(d) for d in self.everywhere(ask)]
        self.kept, failed = applied_everywhere(self.model, self.plans, self.group)
        self.failed.update(failed)
        if 0 not in self.kept:
            raise PlannerError(f"the baseline plan failed to apply ({self.failed[0]})")
        if self.rank0:
            for i, reason in self.failed.items():
                self.session.fail([self.asked[i]], reason, FailKind.ERROR)
        baseline = baseline_name(self.user_plan is not None) + (" (the baseline)" if self.user_plan else "")
        self._log(f"AutoTuner: searched in {time.perf_counter() - t0:.1f} s between two steps: {baseline} and "
                  f"{len(self.kept) - 1} candidate(s) to race")
        self.peaks = [[] for _ in self.plans]
        warm = max(0, self.config.measure.warmup_steps - PEAK_STEPS)
        return [s for i in self.kept for s in [LoopStep(WARMUP, i)] * warm + [LoopStep(PEAK, i)] * PEAK_STEPS]

    def start_race(self) -> list[LoopStep] | None:
        """After the warm-ups: drop the plans over the memory budget, start the schedule; its first block's steps."""
        per_rank = gather_objects([self.peaks[i] for i in self.kept], self.group)
        peaks = [peak_of_steps([rank[j] for rank in per_rank]) for j in range(len(self.kept))]

        def over() -> list[int]:
            return sorted(self.session.over_budget([self.asked[i] for i in self.kept], peaks))

        dropped = set(self.everywhere(over))
        for j in dropped:
            self.failed[self.kept[j]] = "measured peak over the memory budget"
        peaks = [p for j, p in enumerate(peaks) if j not in dropped]
        self.kept = [i for j, i in enumerate(self.kept) if j not in dropped]
        if dropped:
            self._log(f"AutoTuner: {len(dropped)} candidate(s) dropped: measured peak over the memory budget")
        self._step_ms = [[] for _ in self.kept]
        self._per_rank = [[[] for _ in range(dist.get_world_size())] for _ in self.kept]

        def first_block() -> dict:
            self._schedule = self.session.start([self.asked[i] for i in self.kept], peaks)
            return {"block": self._schedule.next_block(), "phase": str(self._schedule.phase)}

        return self._block_steps(self.everywhere(first_block))

    def record_block(self, times: list[float]) -> list[LoopStep] | None:
        """After a block: this rank's step ``times`` (ms, in step order) to the schedule; the next block's steps,
        ``None`` when the schedule is done."""
        reports = gather_objects(times, self.group)
        maxed = max_across_ranks(reports)
        for pos, j in enumerate(step_orders(self.block)):
            self._step_ms[j].append(maxed[pos])
            for r, rep in enumerate(reports):
                self._per_rank[j][r].append(rep[pos])

        def next_block() -> dict:
            self._schedule.record(block_times(self.block, maxed))
            return {"block": self._schedule.next_block(), "phase": str(self._schedule.phase)}

        return self._block_steps(self.everywhere(next_block))

    def _block_steps(self, payload: dict) -> list[LoopStep] | None:
        self.block = payload["block"]
        self.confirming = payload["phase"] == str(Phase.CONFIRM)
        if self.block is None:
            return None
        return [LoopStep(TIMED, self.kept[j]) for j in step_orders(self.block)]

    def conclude(self, default: Plan) -> RoundEnd:
        """Tell the study, finish the session (the recommendation written); the plan to keep, on every rank.

        Raises:
            PlannerError: the study or the plan file could not be written.
        """

        def finish() -> dict:
            plans_measured = self.session.tell([self.asked[i] for i in self.kept], self._step_ms, self._per_rank)
            outcome = self.session.finish(plans_measured, {self.asked[i].number: r for i, r in self.failed.items()})
            self.session.close()
            if self.files[1]:
                self.session.save_profile()
            c = self._schedule.confirmation
            written = outcome.written or default
            survivor = self._schedule.survivor
            here = None
            if c is not None and survivor is not None:
                s = self._schedule
                here = in_process(s.confirm_ms[survivor], s.confirm_ms[s.default])
            return {"plan": written.to_dict(), "line": outcome.best.line(self.config.name) if outcome.best else "",
                    "confirmation": None if c is None else confirmation_attrs(c),
                    "survivor": None if here is None else (plans_measured[survivor].to_dict(),
                                                           plans_measured[survivor].provenance.trial),
                    "here": here, "keeps_baseline": outcome.best is None or outcome.best.keeps_baseline}

        payload = self.everywhere(finish)
        c = payload["confirmation"]
        survivor = payload["survivor"]
        return RoundEnd(Plan.from_dict(payload["plan"]), None if c is None else confirmation_from(c), payload["line"],
                        None if survivor is None else (Plan.from_dict(survivor[0]), survivor[1]), payload["here"],
                        payload["keeps_baseline"])

    def fail(self, plan: int | None, reason: str) -> None:
        """Rank 0: record FAIL the trial of ``plan`` (``FailKind.ERROR``: its step raised; ``None``: none) and
        every other trial still held (``FailKind.INTERRUPTED``: measured by the next tuner); close the session."""
        if not self.rank0 or self.session is None:
            return
        try:
            if plan is not None and plan < len(self.asked):
                self.session.fail([self.asked[plan]], reason, FailKind.ERROR)
            self.session.fail_held(f"not measured: {reason}", FailKind.INTERRUPTED)
        except PlannerError as e:
            logger.warning(f"AutoTuner: could not record the failure in the study: {one_line(e)}")
        finally:
            self.session.close()

    def _log(self, line: str) -> None:
        if self.rank0:
            logger.info(line)


def applied_everywhere(model: nn.Module, plans: list[Plan], group: Any) -> tuple[list[int], dict[int, str]]:
    """Apply each plan on every rank (checked against the model), then the first (the baseline) again.

    Returns:
        The indices of the plans every rank applied, and for each other plan why, rank by rank.
    """
    here = []
    for plan in plans:
        try:
            apply_plan(model, plan, check=True)
            here.append(None)
        except PlannerError as e:
            here.append(one_line(e))
    apply_plan(model, plans[0], check=False)
    outcomes = gather_objects(here, group)
    kept = [i for i in range(len(plans)) if all(o[i] is None for o in outcomes)]
    failed = {i: "applying the plan failed on " + "; ".join(f"rank {r}: {o[i]}" for r, o in enumerate(outcomes)
                                                              if o[i] is not None)
              for i in range(len(plans)) if i not in kept}
    return kept, failed
