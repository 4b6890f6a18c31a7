"""The watched plan: the survivor applied for the rest of the process, each block of K steps running FSDP2's default
twice, the first a washout ([Note: The watch] in :mod:`planner.statistics.watch`), on every rank.

Every rank holds a :class:`~planner.statistics.watch.Watch` with the same seed, so the default's step falls at the
same step everywhere. Each watched step is timed inside ``tuner.step()`` by the tuner's step runner (a ``WATCHED``
step: the device synchronized at its ends, no barrier: a data-parallel step's wall time is the slowest rank's on
every rank). At a block's end rank 0 records it,
decides, and broadcasts the decision on the control group: a revert applies FSDP2's default on every rank before the
next step.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.statistics.watch import Watch, WatchState, WatchStep
from runtime.ranks.collectives import broadcast_from_rank0
from runtime.recording.steps import StepSide
from runtime.timing import WATCHED, RoundStep

# Steps between the watch's log lines of its running ratio.
LOG_EVERY_STEPS = 500
# The watched steps' plans on the step runner: the survivor, and the plan kept without it (FSDP2's default, or the
# plan the model arrived with).
PLAN, KEPT = 0, 1


@dataclass
class WatchedSteps:
    """The watch's side of each of the user's steps (every rank), run by the tuner's step runner.

    Args:
        side: the tuner's step runner (``runtime.recording.steps.StepSide``, its microbatch hook still on); from
            now on its plans are the survivor (applied) and the plan kept.
        watch: this rank's watch (same seed on every rank).
        rank0: whether this rank decides.
    """

    side: StepSide
    watch: Watch
    rank0: bool
    state: WatchState | None = None
    _block: list[WatchStep] | None = None
    _at: int = 0
    _plan_ms: float = 0.0
    _plan_steps: int = 0
    _default_ms: float = 0.0
    _t0: float | None = None
    _logged_at: int = 0

    def __post_init__(self) -> None:
        self.state = self.watch.state()  # no block yet

    def _order(self) -> RoundStep:
        step = self._block[self._at]
        return RoundStep(WATCHED, KEPT if step in (WatchStep.DEFAULT_WASHOUT, WatchStep.DEFAULT) else PLAN)

    def before(self) -> None:
        """Before a step: the plan it runs (applied at a switch: [Note: The watch], the baseline twice, the first a
        washout), the clock read on this rank alone (the module docstring says why)."""
        if self._block is None:
            self._block, self._at = self.watch.next_block(), 0
            self._plan_ms, self._plan_steps, self._default_ms = 0.0, 0, 0.0
        self._t0 = self.side.before(self._order())

    def after(self) -> WatchState | None:
        """After a step: its time kept when it is timed; at a block's end, rank 0's decision on every rank (the
        state, once per block; ``None`` within a block)."""
        self.side.after(self._order(), self._t0, [])
        [ms] = self.side.take_times()
        step = self._block[self._at]
        if step is WatchStep.DEFAULT:
            self._default_ms = ms
        elif step is WatchStep.PLAN:
            self._plan_ms, self._plan_steps = self._plan_ms + ms, self._plan_steps + 1
        self._at += 1
        if self._at < len(self._block):
            return None
        self._block = None
        payload = None
        if self.rank0:
            payload = self.watch.record(self._plan_ms, self._plan_steps, self._default_ms)
        self.state = broadcast_from_rank0(payload, self.side.group)
        if self.state.reverted:
            self.side.apply(KEPT)
        return self.state

    def ends_block(self) -> bool:
        """Whether the step under way is its block's last (:meth:`after` then broadcasts rank 0's decision)."""
        return self._block is not None and self._at + 1 >= len(self._block)

    @property
    def runs_plan(self) -> bool:
        """Whether the step under way (between :meth:`before` and :meth:`after`) runs the watched plan, not FSDP2's
        default."""
        return self._block is not None and self._block[self._at] in (WatchStep.PLAN, WatchStep.PLAN_WASHOUT)

    def due_for_log(self) -> bool:
        """Whether :data:`LOG_EVERY_STEPS` steps passed since the last log line (then counted from now)."""
        if self.state.steps - self._logged_at < LOG_EVERY_STEPS:
            return False
        self._logged_at = self.state.steps
        return True
