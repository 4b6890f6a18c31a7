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

A step that raised on a rank fails the round (:meth:`MeasuredRound.fail`):
the trial of its plan is FAIL (``FailKind.ERROR``: not tried again) and every
other trial of the round FAIL ``FailKind.INTERRUPTED`` (measured by the next
job). The tune job's ranks report the failure at the next collective, where a
peer that failed only because of it (a collective that timed out) is told
apart from the cause, and every rank raises :class:`planner.TrialFailedError`:
the ranks have issued different collectives by then, so the training process
group cannot be trusted and the job stops (exit 3; running ``prefetch-planner
tune`` again resumes the study). In the user's loop the step's exception
propagates from ``tuner.step()``.

The control group's timeout is ``2 * timeout_s + 60`` s: long enough for a
rank that failed early to wait while its peers time out in a training
collective, short enough that no rank waits for ever. If a rank died (no report
at all), the gather fails on the others (``TrialFailedError``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import torch.distributed as dist
from torch import nn

from planner.artifacts.plan import Plan
from planner.errors import FailKind, TrialFailedError, one_line
from planner.statistics.schedule import Phase
from planner.study.in_loop import block_times, step_orders
from runtime.apply import configure_plan
from runtime.ranks.collectives import from_rank0, gather_objects, max_across_ranks
from runtime.recording.peak_memory import PEAK_STEPS, peak_of_steps
from runtime.timing import PEAK, TIMED, WARMUP, RoundStep, StepFailure


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

    def __init__(self, group: dist.ProcessGroup, stage: RoundStage[TrialT] | None = None, warmup_steps: int = 1):
        self.group, self.stage, self.warmup_steps = group, stage, warmup_steps
        self.rank0 = dist.get_rank() == 0
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
        round_.plans, round_.kept = list(plans), list(range(len(plans)))
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
                self.stage.fail([self.asked[i]], self.failed[i], FailKind.ERROR)
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
        reports = [rep["times"] for rep in self._gather({"times": times}, failure)]
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
        fault) and every other trial of the round FAIL ``FailKind.INTERRUPTED`` (measured by the next job)."""
        if not self.rank0 or self.stage is None or not self.asked:
            return
        others = reason
        if plan is not None and plan < len(self.asked):
            self.stage.fail([self.asked[plan]], reason, FailKind.ERROR)
            others = f"trial {self.asked[plan].number} failed in the same round ({reason})"
        self.stage.fail([a for i, a in enumerate(self.asked) if i != plan], f"not measured: {others}",
                        FailKind.INTERRUPTED)

    def _gather(self, report: dict, failure: StepFailure | None) -> list[dict]:
        """Every rank's ``report``; a step that raised on any rank fails the round (the cause, not its victims)."""
        reports = gather_objects(report if failure is None else {"failure": failure}, self.group)
        failures = [(r, rep["failure"]) for r, rep in enumerate(reports) if "failure" in rep]
        if not failures:
            return reports
        causes = [(r, f) for r, f in failures if not f.victim] or failures
        plan = min(f.plan for _, f in causes)
        reason = "; ".join(f"rank {r}: {f.error}" for r, f in causes)
        self.fail(plan, reason)
        trial = f"trial {self.asked[plan].number}" if self.rank0 and self.asked else f"plan {plan}"
        raise TrialFailedError(
            f"{trial} failed on {reason}; it is recorded as FAIL and this job stops (its ranks' process group "
            "is out of step after a failure inside a training step): run `prefetch-planner tune` again to go on"
        )
