"""What the ranks decide after a training step raised on some of them: go on together, or stop.

[Note: A failed step on some ranks]
A step that raised on one rank leaves its peers in one of three places. They raised too (a Python error before a
collective, an out-of-memory error every rank hits at the same allocation). They wait inside a training collective
that the failed rank will never join: NCCL waits until the process group's timeout, then, under torch's default
``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``, its watchdog ends the process with no ``finally`` run. Or they finished the
step (it raised after its last collective) and start the next one.

1. Post. The rank whose step raised posts the failure on the c10d store before any further collective
   (``runtime.ranks.failures.FailureBoard``): the store reaches every rank, where the study's storage may be a
   SQLite file on rank 0's node alone.
2. Record. Rank 0 reads each post as it lands, from a watcher thread that runs while its main thread may be stuck in
   a collective, and records the failed plan's trial FAIL (``FailKind.ERROR``: never measured again) with the cause.
3. Agree. Each rank that reaches a safe point (before a step, before a collective of the control group) while a
   failure is posted writes its report on the store and reads every rank's; :func:`agree` decides alike on every
   rank. The agreement runs on the store, not on the control group: a peer may sit in a control collective that the
   failed rank will never join, and a second collective on that group would pair with it.
4. Bound. A rank that has not reached the agreement ``stuck_after_s`` after its watcher saw the post (the watcher
   looks once a second) is stuck: the watcher aborts its NCCL communicators (the collective raises, and the rank
   reports), and ``ABORT_GRACE_S`` later, or at once where there is nothing to abort (gloo), ends the process
   (exit 3), rank 0 having recorded the cause and failed its other trials first. A rank at the agreement waits for
   the others as long, plus a margin, and then raises. No rank is left to the process group's timeout or NCCL's
   watchdog.

The ranks go on together only when every rank's step raised, none because of a peer (a collective that timed out or
was aborted), in the same step, under the same plan, with no training collective outstanding (every training
group's collective sequence number alike): no collective is then left half-issued, and each rank's training state is
the same. Anything else stops every rank: the process groups are out of step, or the ranks' models differ (one
rank's optimizer step ran, another's did not).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# After aborting a stuck rank's NCCL communicators, how long its collective has to raise before the process ends, s.
ABORT_GRACE_S = 10.0


@dataclass(frozen=True)
class StepFailure:
    """A step that raised on one rank.

    Attributes:
        plan: the index of the plan it ran (``None``: no plan's, the tuner's own work or FSDP2's default recording).
        error: the exception in one line.
        victim: the exception is a collective failing because of another rank (a timeout, a closed peer, an abort).
        out_of_memory: the exception is an allocation the device could not make.
    """

    plan: int | None
    error: str
    victim: bool
    out_of_memory: bool = False


@dataclass(frozen=True)
class StepReport:
    """One rank's word at the agreement after a failure was posted.

    Attributes:
        rank: the rank.
        step: the index of the last step it began (every rank counts alike).
        sequence: its training process groups' collective sequence numbers (``ProcessGroup``'s own counters).
        failure: its step's failure; ``None``: its step did not raise.
    """

    rank: int
    step: int
    sequence: tuple[int, ...]
    failure: StepFailure | None = None


@dataclass(frozen=True)
class Agreement:
    """What every rank does after a failed step.

    Attributes:
        go_on: the ranks are in step and go on together (the Note above says when).
        plan: the plan whose trial fails (``FailKind.ERROR``); ``None``: no plan's fault.
        reason: the causes, one line: ``rank R: error; ...`` (the ranks that failed by themselves, else every
            rank that failed).
        out_of_memory: every cause is out of memory.
        why_stop: why the ranks cannot go on together (empty when they do).
    """

    go_on: bool
    plan: int | None
    reason: str
    out_of_memory: bool
    why_stop: str = ""


def agree(reports: Sequence[StepReport]) -> Agreement:
    """The agreement of the ranks' ``reports`` (one per rank): the same on every rank.

    Raises:
        ValueError: no report holds a failure (nothing was posted).
    """
    failed = [r for r in reports if r.failure is not None]
    if not failed:
        raise ValueError("an agreement needs a failed step")
    causes = [r for r in failed if not r.failure.victim] or failed
    plans = [r.failure.plan for r in causes if r.failure.plan is not None]
    plan = min(plans) if plans else None
    reason = "; ".join(f"rank {r.rank}: {r.failure.error}" for r in causes)
    out_of_memory = all(r.failure.out_of_memory for r in causes)
    why = ""
    if len(failed) < len(reports):
        fine = [r.rank for r in reports if r.failure is None]
        why = f"rank(s) {', '.join(map(str, fine))} finished the step"
    elif any(r.failure.victim for r in failed):
        why = "a rank's collective failed because of a peer"
    elif len({r.step for r in reports}) > 1 or len({r.failure.plan for r in failed}) > 1:
        why = "the ranks failed in different steps"
    elif len({r.sequence for r in reports}) > 1:
        why = "the ranks had issued different training collectives"
    return Agreement(not why, plan, reason, out_of_memory, why)
