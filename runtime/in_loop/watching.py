"""The watched plan: the survivor applied for the rest of the process, each block of K steps running FSDP2's default
twice, the first a washout ([Note: The watch] in :mod:`planner.statistics.watch`), on every rank.

Every rank holds a :class:`~planner.statistics.watch.Watch` with the same seed, so the default's step falls at the
same step everywhere. Each watched step is timed inside ``tuner.step()`` by the tuner's step runner (a ``WATCHED``
step: two events on the current stream, nothing synchronized, no barrier: a data-parallel step's span is the
slowest rank's on every rank, since its collectives wait for it). At a block's end rank 0 records every block whose
events the device has completed (``Event.query()``; a block still running on the device is recorded at a later
block's end, so a decision may come a block late), decides, and broadcasts the decision on the control group: a
revert applies FSDP2's default on every rank before the next step.

[Note: What the watch costs a step]
By design, beyond the plan's own speed, over each block of ``K`` steps (``K`` from
:func:`planner.statistics.watch.watch_every`, between ``MIN_EVERY`` and ``MAX_EVERY``):

- two steps of FSDP2's default (the washout and the timed one): at the confirmed ratio ``r`` they cost
  ``2 (1 / r - 1) / K`` of the block's time, at most ``COST`` (1%) by the choice of ``K``;
- two plan switches (to the default and back), host-side calls of FSDP2's setters between steps
  (``configure_plan``), no device work;
- per step, two CUDA events recorded on the current stream: no synchronization, no barrier, no wait;
- per block, ``Event.query()`` on the unread blocks' last events and one broadcast of rank 0's decision on the gloo
  control group, a host-side collective (the hosts meet; the devices go on with the work queued).

So a watched step never waits for its device; the one wait in a block is the hosts' broadcast, which costs a step
only where a rank's host falls behind its device. The GPU check measures the whole (``bench/gpu_two_ranks.sh``,
stage ``watch-cost``: N watched steps against N plain steps of the same plan, interleaved).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

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
    _unread: deque[list[WatchStep]] = field(default_factory=deque)  # ended blocks whose events are not read yet
    _start: object = None  # the step under way's start mark
    _logged_at: int = 0

    def __post_init__(self) -> None:
        self.state = self.watch.state()  # no block yet

    def _order(self) -> RoundStep:
        step = self._block[self._at]
        return RoundStep(WATCHED, KEPT if step in (WatchStep.DEFAULT_WASHOUT, WatchStep.DEFAULT) else PLAN)

    def before(self) -> None:
        """Before a step: the plan it runs (applied at a switch: [Note: The watch], the baseline twice, the first a
        washout), its start mark on this rank alone (the module docstring says why)."""
        if self._block is None:
            self._block, self._at = self.watch.next_block(), 0
        self._start = self.side.before(self._order())

    def after(self) -> WatchState | None:
        """After a step: its marks kept; at a block's end, rank 0's decision on every rank (the state, once per
        block; ``None`` within a block) on the blocks the device has finished ([Note: What the watch costs a
        step])."""
        self.side.after(self._order(), self._start, [])
        self._at += 1
        if self._at < len(self._block):
            return None
        self._unread.append(self._block)
        self._block = None
        state = self._read()
        self.state = broadcast_from_rank0(state if self.rank0 else None, self.side.group)
        if self.state.reverted:
            self.side.apply(KEPT)
        return self.state

    def _read(self) -> WatchState:
        """Every unread block whose last step the device has finished, in order, recorded on rank 0 (the others
        drop their marks alike); the watch's state after them."""
        while self._unread and (ms := self.side.take_ready(len(self._unread[0]))) is not None:
            block = self._unread.popleft()
            if self.rank0:
                plan = [t for t, step in zip(ms, block, strict=True) if step is WatchStep.PLAN]
                [default] = [t for t, step in zip(ms, block, strict=True) if step is WatchStep.DEFAULT]
                self.watch.record(sum(plan), len(plan), default)
        return self.watch.state()

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
