"""The in-loop tuner's side of the measured round: what happens between the user's steps, on every rank together.

The round is :class:`runtime.measuring.round.MeasuredRound` ([Note: Rank
protocol of a measured round] there), the one the tune job's ranks drive
(``runtime.measuring.measure``); here the user's loop runs its steps
(``runtime.in_loop.autotuner``) and this module calls it between two of them.
What is the in-loop tuner's own: the decision at construction, the session it
opens on the recorded profile, the recording's step kinds, and the end (the
plan kept, the survivor's watch in this process). Rank 0 alone holds the tuning
session (``planner.study.session.TuningSession``) and decides; every exchange
between ranks is a collective on the control group.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from planner.artifacts.config import StudyConfig
from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.plan import Plan, baseline_name
from planner.artifacts.profile import Profile
from planner.errors import FailKind, PlannerError, one_line
from planner.statistics.verdict import Confirmation
from planner.statistics.watch import InProcess, in_process
from planner.storages import check_writable
from planner.study.in_loop import SOURCE, StartDecision, plan_at_start, predicted_start, recheck_config
from planner.study.predicted import predicted_for
from planner.study.records import confirmation_attrs, confirmation_from
from runtime.measuring.round import MeasuredRound
from runtime.ranks.collectives import from_rank0
from runtime.ranks.device import device_of
from runtime.ranks.failures import FailureBoard
from runtime.timing import RoundStep
from search_spaces.session import open_session, optuna_quiet

logger = logging.getLogger("runtime.in_loop.autotuner")

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
        board: the tuner's failure board (``runtime.ranks.failures``); rank 0's round records what is posted on it.

    Attributes:
        measured: the measured round (its plans, the plans kept, the block, the peaks the steps append to).
    """

    def __init__(self, model: nn.Module, config: StudyConfig, group: dist.ProcessGroup,
                 files: tuple[str, str | None], user_plan: Plan | None = None, board: FailureBoard | None = None):
        self.model, self.config, self.group, self.files = model, config, group, files
        self.user_plan = user_plan
        self.rank0 = dist.get_rank() == 0
        self.measured: MeasuredRound = MeasuredRound(group, None, config.measure.warmup_steps, board)
        self.stored_profile: Profile | None = None
        self.start_from: Plan | None = None

    @property
    def session(self) -> Any:
        """Rank 0's tuning session once the search opened it (``None`` before, and on other ranks)."""
        return self.measured.stage

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
        def decide() -> TunerStart:
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
            self.stored_profile = begin.profile
            return TunerStart(decision.tune, decision.why, begin.plan.to_json() if begin.plan else None,
                              begin.profile.microbatches if begin.profile else None)

        return from_rank0(decide, self.group)

    def search(self, profile: Profile | None, recheck: bool = False) -> list[RoundStep]:
        """The simulated stage and the candidates (rank 0), applied and checked everywhere; their warm-up steps.

        Args:
            profile: the profile the session runs on (rank 0's is used; other ranks may pass ``None``).
            recheck: no simulated trial and no new candidate: FSDP2's default and the study's recommendation only
                (``planner.study.in_loop.recheck_config``).

        Raises:
            PlannerError: the session could not ask (storage, budget), or the baseline failed to apply.
        """
        def open_stage() -> Any:
            plan_out, profile_out = self.files
            config = recheck_config(self.config) if recheck else self.config
            session = open_session(config, profile, plan_out=plan_out, profile_out=profile_out or "",
                                   confirm_launches=0, source=SOURCE)
            session.start_from = None if recheck else self.start_from
            session.user_plan = self.user_plan
            return session

        clock = device_of("cpu").clock  # the host's: a search runs on the host
        t0 = clock()
        with optuna_quiet():  # not a line per simulated trial in the user's log
            self.measured.ask(open_stage)
        steps = self.measured.apply_everywhere(self.model)
        if steps is None:
            raise PlannerError(f"the baseline plan failed to apply ({self.measured.failed[0]})")
        baseline = baseline_name(self.user_plan is not None) + (" (the baseline)" if self.user_plan else "")
        self._log(f"AutoTuner: searched in {clock() - t0:.1f} s between two steps: {baseline} and "
                  f"{len(self.measured.kept) - 1} candidate(s) to race")
        return steps

    def start_race(self) -> list[RoundStep] | None:
        """After the warm-ups: the plans over the memory budget left out, the schedule started; its first block's
        steps (:meth:`MeasuredRound.start`)."""
        before = len(self.measured.kept)
        steps = self.measured.start()
        if len(self.measured.kept) < before:
            self._log(f"AutoTuner: {before - len(self.measured.kept)} candidate(s) left out: measured peak over the "
                      "memory budget")
        return steps

    def record_block(self, times: list[float]) -> list[RoundStep] | None:
        """After a block: this rank's step ``times`` (ms, in step order) to the schedule; the next block's steps,
        ``None`` when the schedule is done (:meth:`MeasuredRound.record`)."""
        return self.measured.record(times)

    def conclude(self, default: Plan) -> RoundEnd:
        """Tell the study, finish the session (the recommendation written); the plan to keep, on every rank.

        Raises:
            PlannerError: the study or the plan file could not be written.
        """

        def finish() -> dict:
            plans_measured = self.measured.tell()
            outcome = self.session.finish(plans_measured, self.measured.failed_trials())
            self.session.close()
            if self.files[1]:
                self.session.save_profile()
            s = self.measured.schedule
            c, survivor = s.confirmation, s.survivor
            written = outcome.written or default
            here = None
            if c is not None and survivor is not None:
                here = in_process(s.confirm_ms[survivor], s.confirm_ms[s.default])
            return {"plan": written.to_dict(), "line": outcome.best.line(self.config.name) if outcome.best else "",
                    "confirmation": None if c is None else confirmation_attrs(c),
                    "survivor": None if here is None else (plans_measured[survivor].to_dict(),
                                                           plans_measured[survivor].provenance.trial),
                    "here": here, "keeps_baseline": outcome.best is None or outcome.best.keeps_baseline}

        payload = from_rank0(finish, self.group)
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
            self.measured.fail(plan, reason)
            self.session.fail_held(f"not measured: {reason}", FailKind.INTERRUPTED)
        except PlannerError as e:
            logger.warning(f"AutoTuner: could not record the failure in the study: {one_line(e)}")
        finally:
            self.session.close()

    def _log(self, line: str) -> None:
        if self.rank0:
            logger.info(line)

