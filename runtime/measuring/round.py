"""The measured round as a state machine of steps: every rank holds one, and two drivers run its steps.

[Note: Rank protocol of a measured round]
Every rank holds a :class:`MeasuredRound` and calls it at the same points;
rank 0 alone holds the study's side (a :class:`RoundStage`:
``planner.study.session.TuningSession``) and decides. Each call between two
stretches of steps is one collective on the control group
(``runtime.ranks.collectives.control_group``) and hands back the steps to run
next as :class:`RoundStep` s, until the schedule is done.

1. Ask (:meth:`MeasuredRound.ask`). Rank 0 asks the study for the round's
   trials (the baseline first, then re-queued plans of dead jobs, then the
   best simulated plans not yet measured) and broadcasts their plans; a
   planner error there raises on every rank.
2. Apply (:meth:`MeasuredRound.apply_everywhere`). Every rank applies every
   plan to its own model (fingerprint checked) and the outcomes are
   all-gathered. A plan that raised on any rank is FAIL on every rank (the
   reason names the rank and the exception, ``FailKind.ERROR``); the round
   goes on without it (without the baseline there is no round).
3. Warm up. Per plan, ``warmup_steps - PEAK_STEPS`` plain steps, then
   ``PEAK_STEPS`` steps measuring this rank's peak memory
   (``runtime.recording.peak_memory``).
4. Budget (:meth:`MeasuredRound.start`). A plan's peak is the median over
   its peak steps of the max across ranks; rank 0 records FAIL the
   candidates over the memory budget (``FailKind.ERROR``), every rank leaves
   them out, and rank 0's schedule (the race, then the confirmation:
   ``planner.statistics.schedule``) hands out its first block of rounds.
5. Blocks (:meth:`MeasuredRound.record`). After each block the ranks'
   step times are all-gathered; rank 0 feeds each step's max across ranks to
   the schedule, which drops candidates or hands out the next block. When it
   is done, rank 0 tells each trial its measurements and stores every rank's
   own times (:meth:`MeasuredRound.tell`).

A step that raised goes to the failure board ([Note: A failed step on some ranks] in
``planner.failed_steps``): the rank posts it on the c10d store before any further collective, rank 0
records the plan's trial FAIL (``FailKind.ERROR``: not tried again) from the post, and the ranks agree on the store
at their next safe point (before a step, before a block's gather); a rank stuck in a collective is stopped within
``[launch] stuck_after_s``. Where every rank's step raised in step (:func:`planner.failed_steps.agree`),
the ranks go on together: the plan is left out, FSDP2's iteration state reset, the warm-ups not run yet run, and
the schedule starts afresh over the plans kept (the rounds before are dropped: a schedule's design holds its
plans from its first block). Otherwise every other trial of the round is FAIL ``FailKind.INTERRUPTED`` (measured
by the next job) and every rank raises :class:`planner.TrialFailedError`: the training process group cannot be
trusted and the job stops (exit 3; running ``prefetch-planner tune`` again resumes the study). A round of fixed
plans (no study, no board) fails at the next gather as a whole. In the user's loop the in-loop tuner acts on the
agreement (``runtime.in_loop.autotuner``).

The control group's timeout is ``2 * timeout_s + 60`` s: long enough for a
rank that failed early to wait while its peers time out in a training
collective, short enough that no rank waits for ever. If a rank died (no report
at all), the gather fails on the others (``TrialFailedError``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import torch.distributed as dist
from torch import nn

from planner.artifacts.plan import Plan
from planner.errors import FailKind, TrialFailedError, one_line
from planner.failed_steps import StepFailure
from planner.statistics.schedule import Phase
from planner.study.in_loop import block_times, step_orders
from runtime.apply import configure_plan
from runtime.out_of_memory import recover
from runtime.ranks.collectives import from_rank0, gather_objects, max_across_ranks
from runtime.ranks.failures import FailureBoard
from runtime.recording.peak_memory import PEAK_STEPS, peak_of_steps
from runtime.timing import PEAK, TIMED, WARMUP, RoundStep

logger = logging.getLogger(__name__)


class RoundTrial(Protocol):
    """A trial of the round as rank 0 holds it (``planner.study.MeasuredTrial``)."""

    @property
    def number(self) -> int:
        """The Optuna trial number."""

    @property
    def plan(self) -> Plan:
        """The plan every rank measures."""


TrialT = TypeVar("TrialT", bound=RoundTrial)


class Scheduler(Protocol):
    """Rank 0's schedule of a round's steps (``planner.statistics.schedule.Schedule``)."""

    @property
    def phase(self) -> Phase:
        """Racing or confirming (the block :meth:`next_block` hands out next belongs to it)."""

    def next_block(self) -> list[list[int]] | None:
        """The next rounds (positions among the plans kept, in running order), ``None`` when done."""

    def record(self, block: list[dict[int, float]]) -> None:
        """The block's step times: per round, position -> ms (max across ranks)."""


class RoundStage(Protocol[TrialT]):
    """What rank 0 asks and tells the study in a round (``planner.study.session.TuningSession``)."""

    def prepare(self) -> list[TrialT]:
        """The round's RUNNING trials, the baseline first (step 1)."""

    def over_budget(self, kept: list[TrialT], peak_bytes: list[int]) -> dict[int, str]:
        """Position in ``kept`` -> why, for the trials whose measured peak exceeds the memory budget, recorded FAIL
        (never the baseline)."""

    def start(self, kept: list[TrialT], peak_bytes: list[int]) -> Scheduler:
        """The schedule of the trials that applied on every rank and fit (the baseline first), with their peaks."""

    def tell(self, asked: list[TrialT], step_ms: list[list[float]], per_rank: list[list[list[float]]]) -> list[Plan]:
        """Record the measured trials: per trial, every step's max across ranks and every rank's own times, ms."""

    def fail(self, asked: list[TrialT], reason: str, kind: FailKind) -> None:
        """Record the trials FAIL with a one-line ``reason``."""


def warm_up_steps(plans: Sequence[int], warmup_steps: int) -> list[RoundStep]:
    """Each plan's warm-up: ``warmup_steps - PEAK_STEPS`` plain steps if that is positive, then ``PEAK_STEPS`` peak
    steps (which warm up as well)."""
    plain = max(0, warmup_steps - PEAK_STEPS)
    return [s for i in plans for s in [RoundStep(WARMUP, i)] * plain + [RoundStep(PEAK, i)] * PEAK_STEPS]


class MeasuredRound(Generic[TrialT]):
    """One measured round on every rank (the Note above); every method is called by every rank together.

    Args:
        group: the control group (``runtime.ranks.collectives.control_group``).
        stage: rank 0: the study's side of the round; ``None`` on the other ranks, and for a round of fixed
            plans (:meth:`of_plans`).
        warmup_steps: untimed steps per plan before the first block.
        board: the failure board every rank opened (``runtime.ranks.failures``); ``None``: a step that raised
            fails the round at the next gather.

    Attributes:
        plans: the round's plans (0: the baseline), on every rank once asked.
        kept: the indices of the plans still in the round (applied everywhere, within the budget).
        failed: plan index -> why it failed (rank 0's reasons are the ones recorded).
        peaks: per plan, this rank's peak per peak step, bytes; the drivers append to it.
        block: the block of rounds being run (positions in :attr:`kept`); ``None`` before and after.
        confirming: the block belongs to the confirmation.
        step_ms: per kept plan, every timed step's max across ranks, ms.
        per_rank: per kept plan, per rank, that rank's own step times, ms.
    """

    def __init__(self, group: dist.ProcessGroup, stage: RoundStage[TrialT] | None = None, warmup_steps: int = 1,
                 board: FailureBoard | None = None):
        self.group, self.stage, self.warmup_steps, self.board = group, stage, warmup_steps, board
        self.rank0 = dist.get_rank() == 0
        self.model: nn.Module | None = None
        self._fixed = False  # a round of fixed plans (of_plans): a failed step always stops it
        self.started = False  # a schedule is running (every rank; rank 0 alone holds it)
        self._told: set[int] = set()  # plans whose trial is recorded FAIL by this round
        self._lock = threading.Lock()  # rank 0: the board's watcher records beside the main thread
        if board is not None and self.rank0:
            board.attach(self._fail_cause, self._stopped)
        self.plans: list[Plan] = []
        self.asked: list[TrialT] = []
        self.kept: list[int] = []
        self.failed: dict[int, str] = {}
        self.peaks: list[list[int]] = []
        self.block: list[list[int]] | None = None
        self.confirming = False
        self.schedule: Scheduler | None = None
        self.step_ms: list[list[float]] = []
        self.per_rank: list[list[list[float]]] = []

    @classmethod
    def of_plans(cls, plans: Sequence[Plan], group: dist.ProcessGroup | None) -> MeasuredRound:
        """A round of fixed plans, all kept, with no study (what a confirmation launch or a bench measures)."""
        round_: MeasuredRound = cls(group)
        round_.plans, round_.kept, round_._fixed = list(plans), list(range(len(plans))), True
        return round_

    def everywhere(self, compute: Callable[[], Any]) -> Any:
        """``compute()`` on rank 0, its result on every rank (``runtime.ranks.collectives.from_rank0`` on the
        control group).

        Raises:
            PlannerError: ``compute`` raised on rank 0 (every rank raises it).
        """
        return from_rank0(compute, self.group)

    # -- 1 and 2: ask, apply -----------------------------------------------------------------------------------

    def ask(self, open_stage: Callable[[], RoundStage[TrialT]] | None = None) -> list[Plan]:
        """Step 1: rank 0's trials (its stage opened first by ``open_stage``, if given); their plans on every rank.

        Raises:
            PlannerError: rank 0 could not ask the study (bad storage, budget, ...).
        """
        def ask() -> list[dict]:
            if open_stage is not None:
                self.stage = open_stage()
            self.asked = self.stage.prepare()
            return [a.plan.to_dict() for a in self.asked]

        self.plans = [Plan.from_dict(d) for d in self.everywhere(ask)]
        self.peaks = [[] for _ in self.plans]
        return self.plans

    def apply_everywhere(self, model: nn.Module) -> list[RoundStep] | None:
        """Step 2: apply every plan on every rank (fingerprint checked), then the baseline again; the plans that
        raised anywhere are FAIL (``FailKind.ERROR``) and left out.

        Returns:
            The warm-up steps of the plans kept (:func:`warm_up_steps`); ``None`` when the baseline failed to
            apply (every trial is then FAIL: nothing to compare with).
        """
        self.model = model
        here = []
        for plan in self.plans:
            try:
                configure_plan(model, plan, check=True)
                here.append(None)
            except Exception as e:  # noqa: BLE001 - any exception fails this plan, not the round
                here.append(one_line(e))
        configure_plan(model, self.plans[0], check=False)
        outcomes = gather_objects(here, self.group)
        self.kept = [i for i in range(len(self.plans)) if all(o[i] is None for o in outcomes)]
        for i in range(len(self.plans)):
            if i not in self.kept:
                self.failed[i] = "applying the plan failed on " + "; ".join(
                    f"rank {r}: {o[i]}" for r, o in enumerate(outcomes) if o[i] is not None)
        if self.rank0:
            for i in sorted(self.failed):
                self._fail_cause(i, self.failed[i])
        if 0 not in self.kept:
            if self.rank0:
                self.stage.fail(self.asked, "not measured: the baseline plan failed to apply, so there is nothing to "
                                            "compare with", FailKind.INTERRUPTED)
            return None
        return warm_up_steps(self.kept, self.warmup_steps)

    # -- 4 and 5: the budget, the blocks -----------------------------------------------------------------------

    def start(self, failure: StepFailure | None = None) -> list[RoundStep] | None:
        """Step 4, after the warm-ups: the plans over the memory budget left out, the schedule started; its first
        block's steps (``None``: the schedule is done already).

        Args:
            failure: this rank's warm-up step that raised, if one did.

        Raises:
            TrialFailedError: a warm-up step raised on some rank (the round's trials are FAIL).
            PlannerError: rank 0 could not start the schedule.
        """
        reports = self._gather({"peaks": [self.peaks[i] for i in self.kept]}, failure)
        if reports is None:  # the ranks went on from a failed step without its plan
            return self._go_on()
        peaks = [peak_of_steps([rep["peaks"][j] for rep in reports]) for j in range(len(self.kept))]

        def over() -> list[int]:
            reasons = self.stage.over_budget([self.asked[i] for i in self.kept], peaks)
            self.failed.update({self.kept[j]: why for j, why in reasons.items()})
            return sorted(reasons)

        left_out = set(self.everywhere(over))
        for j in left_out:
            self.failed.setdefault(self.kept[j], "measured peak over the memory budget")
        self.kept = [i for j, i in enumerate(self.kept) if j not in left_out]
        peaks = [p for j, p in enumerate(peaks) if j not in left_out]
        return self.begin(lambda: self.stage.start([self.asked[i] for i in self.kept], peaks))

    def begin(self, schedule: Callable[[], Scheduler]) -> list[RoundStep] | None:
        """Rank 0's schedule (``schedule()``, called there) over the plans kept; its first block's steps."""
        self.step_ms = [[] for _ in self.kept]
        self.per_rank = [[[] for _ in range(dist.get_world_size())] for _ in self.kept]
        self.started = True

        def first() -> dict:
            self.schedule = schedule()
            return self._next()

        return self._block_steps(self.everywhere(first))

    def record(self, times: list[float], failure: StepFailure | None = None) -> list[RoundStep] | None:
        """Step 5, after a block: this rank's step ``times`` (ms, in step order) to the schedule; the next block's
        steps, ``None`` when the schedule is done.

        Raises:
            TrialFailedError: a step of the block raised on some rank (the round's trials are FAIL).
            PlannerError: rank 0's schedule could not go on.
        """
        if not self.started:  # the warm-ups of a round that went on from a failed step
            return self.start(failure)
        gathered = self._gather({"times": times}, failure)
        if gathered is None:
            return self._go_on()
        reports = [rep["times"] for rep in gathered]
        maxed = max_across_ranks(reports)
        for pos, j in enumerate(step_orders(self.block)):
            self.step_ms[j].append(maxed[pos])
            for r, rep in enumerate(reports):
                self.per_rank[j][r].append(rep[pos])

        def next_block() -> dict:
            self.schedule.record(block_times(self.block, maxed))
            return self._next()

        return self._block_steps(self.everywhere(next_block))

    def _next(self) -> dict:
        block = self.schedule.next_block()
        return {"block": block, "confirming": self.schedule.phase == Phase.CONFIRM}

    def _block_steps(self, payload: dict) -> list[RoundStep] | None:
        self.block = payload["block"]
        self.confirming = payload["confirming"]
        if self.block is None:
            return None
        return [RoundStep(TIMED, self.kept[j]) for j in step_orders(self.block)]

    def tell(self) -> list[Plan]:
        """Rank 0, the schedule done: tell the study each kept trial's measurements; the measured plans (provenance
        filled in), in :attr:`kept` order."""
        return self.stage.tell([self.asked[i] for i in self.kept], self.step_ms, self.per_rank)

    def failed_trials(self) -> dict[int, str]:
        """Rank 0: trial number -> why, for the round's failed trials."""
        return {self.asked[i].number: why for i, why in self.failed.items()} if self.asked else {}

    # -- failures ----------------------------------------------------------------------------------------------

    def fail(self, plan: int | None, reason: str) -> None:
        """Rank 0: the trial of ``plans[plan]`` FAIL (``FailKind.ERROR``: its step raised; ``None``: no plan's
        fault) and every other trial of the round FAIL ``FailKind.INTERRUPTED`` (measured by the next job); a trial
        recorded already is left as it is."""
        if not self.rank0 or self.stage is None or not self.asked:
            return
        others = reason
        if plan is not None and plan < len(self.asked):
            self._fail_cause(plan, reason)
            others = f"trial {self.asked[plan].number} failed in the same round ({reason})"
        self._fail_rest(f"not measured: {others}")

    def _fail_cause(self, plan: int | None, reason: str) -> None:
        """Rank 0: the trial of ``plans[plan]`` FAIL ``FailKind.ERROR`` with ``reason``, once."""
        with self._lock:
            if plan is None or plan in self._told or self.stage is None or plan >= len(self.asked):
                return
            self._told.add(plan)
            self.failed.setdefault(plan, reason)
            self.stage.fail([self.asked[plan]], reason, FailKind.ERROR)

    def _fail_rest(self, reason: str) -> None:
        """Rank 0: every trial of the round not recorded yet FAIL ``FailKind.INTERRUPTED`` with ``reason``."""
        with self._lock:
            rest = [i for i in range(len(self.asked)) if i not in self._told]
            self._told.update(rest)
            if rest and self.stage is not None:
                self.stage.fail([self.asked[i] for i in rest], reason, FailKind.INTERRUPTED)

    def _stopped(self, reason: str) -> None:
        """Rank 0, before the board's watcher ends the process: every trial of the round not recorded, and every
        other trial the stage holds (``fail_held``), FAIL ``FailKind.INTERRUPTED``."""
        self._fail_rest(reason)
        fail_held = getattr(self.stage, "fail_held", None)
        if fail_held is not None:
            fail_held(reason, FailKind.INTERRUPTED)

    def _gather(self, report: dict, failure: StepFailure | None) -> list[dict] | None:
        """Every rank's ``report``; ``None`` when a step raised and the ranks go on without its plan (the board's
        agreement); a step that raised anywhere otherwise fails the round (the cause, not its victims).

        Raises:
            TrialFailedError: the ranks stop (the round's trials are FAIL).
        """
        if self.board is not None and (failure is not None or self.board.posted()):
            self._agree(failure)
            return None
        reports = gather_objects(report if failure is None else {"failure": failure}, self.group)
        failures = [(r, rep["failure"]) for r, rep in enumerate(reports) if "failure" in rep]
        if not failures:
            return reports
        causes = [(r, f) for r, f in failures if not f.victim] or failures
        plan = min(f.plan for _, f in causes)
        self._stop(plan, "; ".join(f"rank {r}: {f.error}" for r, f in causes))

    def _agree(self, failure: StepFailure | None) -> None:
        """The board's agreement on a failed step: the plan left out when the ranks go on (a candidate of a round
        with a study, every rank's step raised in step), else :meth:`_stop`."""
        agreement = self.board.agree(failure)
        plan = agreement.plan
        if not (agreement.go_on and plan not in (None, 0) and plan in self.kept and not self._fixed):
            self._stop(plan, agreement.reason, agreement.why_stop)
        self.failed.setdefault(plan, agreement.reason)  # rank 0's trial: recorded by the board's agreement
        self.kept = [i for i in self.kept if i != plan]
        recover(self.model)  # every rank stopped at the same point: FSDP2's iteration state and gradients reset
        if self.rank0:
            what = f"trial {self.asked[plan].number}" if self.asked else f"plan {plan}"
            logger.warning(f"{what} failed on every rank in the same step ({agreement.reason}); it is FAIL and the "
                           f"round goes on without it: the race starts again over the {len(self.kept)} plans kept")

    def _go_on(self) -> list[RoundStep] | None:
        """After the ranks went on from a failed step: the warm-ups still owed (plans with fewer peak steps than
        :data:`PEAK_STEPS`), else a fresh schedule over the plans kept (:meth:`start`)."""
        self.started, self.block, self.schedule = False, None, None
        owed = [i for i in self.kept if len(self.peaks[i]) < PEAK_STEPS]
        for i in owed:
            self.peaks[i] = []
        if owed:
            return warm_up_steps(owed, self.warmup_steps)
        return self.start()

    def _stop(self, plan: int | None, reason: str, why: str = "") -> None:
        """The round's trials FAIL (:meth:`fail`), and every rank raises."""
        self.fail(plan, reason)
        trial = f"trial {self.asked[plan].number}" if self.rank0 and self.asked and plan is not None else (
            f"plan {plan}" if plan is not None else "a step")
        because = f" ({why})" if why else ""
        raise TrialFailedError(
            f"{trial} failed on {reason}; it is recorded as FAIL and this job stops{because}: the ranks' process "
            "groups are out of step after a failure inside a training step: run `prefetch-planner tune` again to "
            "go on"
        )
