"""The in-loop tuner's answer to a step that raised: the ranks' agreement on the failure board, then a skipped step,
the error propagated, or this rank stopped because a peer's step raised ([Note: A failed step on some ranks] in
:mod:`planner.failed_steps`).

:class:`FailedSteps` is the part of :class:`runtime.in_loop.autotuner.AutoTuner` that answers; the tuner calls it
from ``tuner.step()`` and between steps, and it acts on the tuner's state (its board, round, step runner, phase
and plans).
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from planner.errors import TrialFailedError, one_line
from planner.failed_steps import Agreement
from planner.study.in_loop import TunerPhase
from runtime.apply import configure_plan
from runtime.out_of_memory import recover, recoverable
from runtime.timing import RoundStep, step_failure

logger = logging.getLogger("runtime.in_loop.autotuner")


class FailedSteps:
    """What :class:`runtime.in_loop.autotuner.AutoTuner` does when a step raises on some rank (mixed into it; it
    calls the tuner's ``_abandon``, ``_kept``, ``_finish_with``, ``_store_watch`` and ``_baseline_name``)."""

    _board: Any
    _round: Any
    _steps: Any
    _watching: Any
    _watched_trial: int | None
    model: Any
    phase: TunerPhase
    on_oom: str

    def _agreed(self, plan: int | None, e: BaseException) -> Agreement | None:
        """This rank's step (or the tuner's work between steps) raised ``e`` under ``plan``: posted, and the ranks'
        agreement (``None`` for an interrupt, which every rank receives from the launcher, or when a peer never
        reported: it is stopped by its own bound, and ``e`` propagates here)."""
        if not isinstance(e, Exception):
            return None
        try:
            return self._board.agree(step_failure(plan, e))
        except TrialFailedError as stuck:
            logger.warning(f"AutoTuner: rank {dist.get_rank()}: {stuck}")
            return None

    def _stop_for_peer(self) -> None:
        """A peer's step raised and this rank's did not: the agreement (it stops the ranks), the trial recorded,
        the tuner done.

        Raises:
            TrialFailedError: always.
        """
        agreement = self._board.agree(None)
        self._round.fail(agreement.plan, agreement.reason)
        self._abandon(f"a peer's step raised ({agreement.reason})")
        raise TrialFailedError(f"AutoTuner: {agreement.reason}; this rank's step finished ({agreement.why_stop}), so "
                               "the ranks cannot go on together: the tuner recorded the failure, and this process "
                               "stops here rather than wait in a collective the failed rank will not join")

    def _skipped_out_of_memory(self, order: RoundStep, e: BaseException) -> bool:
        """A user's step that ran a candidate (racing or confirming, not FSDP2's default) ran out of memory on every
        rank in step (the board's agreement): the candidate's trial is FAIL with the reason, the plan kept is applied
        (the model's own, else FSDP2's default), FSDP2's iteration state and the partial gradients are cleared
        (``runtime.out_of_memory.recover``), and the step is skipped with one logged line. ``on_oom="raise"``,
        any other error, a step under the baseline (FSDP2's default, or the plan the model arrived with: what the
        job runs without the tuner), or ranks that cannot go on together: ``False``, and the error propagates."""
        candidate = order.plan if self.phase in (TunerPhase.RACING, TunerPhase.CONFIRMING) else None
        agreement = self._agreed(candidate, e)
        if (agreement is None or not agreement.go_on or not agreement.out_of_memory or self.on_oom == "raise"
                or not recoverable(self.model, e) or not candidate):
            return False
        reason = f"out of memory on every rank in a step that ran candidate {order.plan}: {agreement.reason}"
        self._round.fail(order.plan, reason)
        self._steps.abandon()
        recover(self.model)
        self._abandon(reason)
        logger.warning(f"AutoTuner: rank {dist.get_rank()} skipped this step (its optimizer step did not run; the "
                       "failed step's gradients are cleared): the candidate it ran is out of the race")
        return True

    def _watched_out_of_memory(self, e: BaseException) -> bool:
        """A watched step that ran the survivor ran out of memory on every rank in step: as
        :meth:`_skipped_out_of_memory`, the plan kept applied instead for the rest of the process (the study keeps
        the plan's confirmation; the watch is stored as it stood)."""
        agreement = self._agreed(None, e)
        if (agreement is None or not agreement.go_on or self.on_oom == "raise" or not recoverable(self.model, e)
                or not self._watching.runs_plan):
            return False
        recover(self.model)
        kept = self._kept()
        configure_plan(self.model, kept, check=False)
        if self._watching.state.blocks:
            self._store_watch(self._watching.state)
        self._finish_with(kept)
        logger.warning(f"AutoTuner: rank {dist.get_rank()} skipped this step: trial {self._watched_trial}'s plan ran "
                       f"out of memory ({one_line(e)}); "
                       + self._baseline_name()
                       + " is applied for the rest of the process")
        return True

    def _step_failed(self, order: RoundStep, e: BaseException) -> None:
        self._steps.abandon()
        reason = f"a training step raised on rank {dist.get_rank()}: {one_line(e)}"
        self._round.fail(order.plan if self.phase != TunerPhase.RECORDING else None, reason)
        self._abandon(f"a step raised inside tuner.step() ({one_line(e)})")
