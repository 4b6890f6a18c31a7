"""The failure board: a failed step posted on the c10d store, the ranks' agreement there, and the watcher that stops a
rank stuck in a collective ([Note: A failed step on some ranks] in :mod:`planner.failed_steps`).

Every rank of a tune job or an in-loop tuner opens one board (:meth:`FailureBoard.open`, a collective on the
control group) and closes it when it is done. Keys live under ``prefetch-planner/<token>/<epoch>/``: a token rank 0
draws per board (torchrun's agent keeps its store across restarts, so an earlier attempt's keys are never read), an
epoch per failure the ranks went on from.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from planner.errors import TrialFailedError
from planner.failed_steps import ABORT_GRACE_S, Agreement, StepFailure, StepReport, agree
from runtime.ranks.collectives import from_rank0
from runtime.ranks.torch_private import abort_nccl, collective_sequence, default_store, live_groups

logger = logging.getLogger(__name__)

# How often the watcher looks for a post, s: one store lookup a second per rank, and a post seen at most this late.
WATCH_POLL_S = 1.0
# What a rank at the agreement waits beyond a stuck peer's bound before it gives up on that peer, s.
AGREE_MARGIN_S = 10.0
# The exit status of a process the watcher stops: the tune job's for a failed trial (planner.TrialFailedError).
STOPPED_EXIT = TrialFailedError.exit_code


def _dump(value: Any) -> str:
    return json.dumps(dataclasses.asdict(value))


def _failure(text: bytes | str) -> StepFailure:
    return StepFailure(**json.loads(text))


def _report(text: bytes | str) -> StepReport:
    d = json.loads(text)
    failure = None if d["failure"] is None else StepFailure(**d["failure"])
    return StepReport(d["rank"], d["step"], tuple(d["sequence"]), failure)


class FailureBoard:
    """One rank's side of the board.

    Args:
        store: the c10d store every rank reaches (the default process group's).
        prefix: the board's keys' prefix (the same on every rank).
        stuck_after_s: how long after a post a rank may stay out of the agreement before its watcher stops it, s
            (``[launch] stuck_after_s``).
        control: the control group, left out of the training groups' sequence numbers.

    Attributes:
        steps: the steps this rank began under the board (:meth:`before_step`); every rank counts alike.
    """

    def __init__(self, store: Any, prefix: str, stuck_after_s: float, control: Any = None):
        self.store, self.prefix, self.stuck_after_s, self.control = store, prefix, stuck_after_s, control
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.steps = 0
        self._record: Callable[[int | None, str], None] | None = None
        self._on_stop: Callable[[str], None] | None = None
        self._lock = threading.RLock()
        self._epoch = 0
        self._recorded: set[int] = set()
        self._at_agreement = threading.Event()
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None

    @classmethod
    def open(cls, group: Any, stuck_after_s: float) -> FailureBoard:
        """Every rank: a board on the default store under a token rank 0 draws, its watcher started."""
        token = from_rank0(lambda: uuid.uuid4().hex, group)
        board = cls(default_store(), f"prefetch-planner/{token}", stuck_after_s, group)
        board._watcher = threading.Thread(target=board._watch, name="prefetch-planner-failures", daemon=True)
        board._watcher.start()
        atexit.register(board.close)  # before the interpreter ends: a thread left inside the store's C++ aborts it
        return board

    def attach(self, record: Callable[[int | None, str], None], on_stop: Callable[[str], None]) -> None:
        """Rank 0: ``record(plan, reason)`` fails the failed plan's trial (``FailKind.ERROR``, once per failure);
        ``on_stop(reason)`` fails the other trials it holds before the watcher ends the process."""
        self._record, self._on_stop = record, on_stop

    def close(self) -> None:
        """The board is done: its watcher ends (within one store lookup)."""
        self._closed.set()
        watcher = self._watcher
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(timeout=2 * WATCH_POLL_S)
        atexit.unregister(self.close)

    # -- the main thread ---------------------------------------------------------------------------------------------

    def before_step(self) -> bool:
        """A safe point before a step: whether a failure is posted (then the caller goes to the agreement and runs
        no step); else the step is counted."""
        if self.posted():
            return True
        self.steps += 1
        return False

    def posted(self) -> bool:
        """Whether a rank posted a failure the ranks have not agreed on yet (one store lookup)."""
        return bool(self.store.check([self._key(self._epoch, "posted")]))

    def post(self, failure: StepFailure) -> None:
        """This rank's step raised: the failure on the store, before any further collective (rank 0 records it at
        once; the others' posts reach rank 0's watcher)."""
        epoch = self._epoch
        self.store.set(self._key(epoch, "failure", self.rank), _dump(failure))
        self.store.set(self._key(epoch, "posted"), str(self.rank))
        if self.rank == 0:
            self._record_posts(epoch, self.store)

    def agree(self, failure: StepFailure | None = None) -> Agreement:
        """This rank's report (``failure``: its own step's, posted first; ``None``: its step did not raise), every
        rank's read back, and their agreement (:func:`planner.failed_steps.agree`), the same on every rank.

        Raises:
            TrialFailedError: a rank did not report within its bound and :data:`AGREE_MARGIN_S` (its own watcher
                stops it); the board is closed.
        """
        if failure is not None and not self.posted_by_me():
            self.post(failure)
        epoch = self._epoch
        self._at_agreement.set()
        try:
            report = StepReport(self.rank, self.steps, self._sequence(), failure)
            self.store.set(self._key(epoch, "report", self.rank), _dump(report))
            keys = [self._key(epoch, "report", r) for r in range(self.world)]
            wait_s = self.stuck_after_s + ABORT_GRACE_S + AGREE_MARGIN_S
            try:
                self.store.wait(keys, datetime.timedelta(seconds=wait_s))
            except Exception:  # noqa: BLE001 - the store's timeout, or the store gone with a stopped rank
                missing = [r for r, k in enumerate(keys) if not self._check(k)]
                self.close()
                raise TrialFailedError(
                    f"rank(s) {', '.join(map(str, missing)) or '?'} did not report within {wait_s:.0f} s of a "
                    f"failed step (stuck in a collective, they are stopped by their own bound: [launch] "
                    f"stuck_after_s = {self.stuck_after_s:g})", local=True) from None
            agreement = agree([_report(v) for v in self.store.multi_get(keys)])
            self.record(epoch, agreement.plan, agreement.reason)
            with self._lock:
                self._epoch += 1
            return agreement
        finally:
            self._at_agreement.clear()

    def leave(self, failure: StepFailure) -> None:
        """This rank raised outside a step the ranks agree on (the recording, the tuner's own work) and stops: its
        failure posted and its report written without waiting, so a peer at the agreement reads it at once and a
        peer stuck in a collective is stopped by its watcher."""
        if not self.posted_by_me():
            self.post(failure)
        report = StepReport(self.rank, self.steps, self._sequence(), failure)
        self.store.set(self._key(self._epoch, "report", self.rank), _dump(report))

    def posted_by_me(self) -> bool:
        """Whether this rank posted a failure in the current epoch."""
        return self._check(self._key(self._epoch, "failure", self.rank))

    def record(self, epoch: int, plan: int | None, reason: str) -> None:
        """Rank 0: ``record(plan, reason)`` once per failure (a storage error is logged: the ranks go on to stop)."""
        with self._lock:
            if self.rank != 0 or self._record is None or epoch in self._recorded:
                return
            self._recorded.add(epoch)
            try:
                self._record(plan, reason)
            except Exception as e:  # noqa: BLE001 - the failure itself is what the ranks act on
                logger.warning(f"could not record the failed step in the study: {e}")

    # -- the watcher thread ------------------------------------------------------------------------------------------

    def _watch(self) -> None:
        """Look for a post every :data:`WATCH_POLL_S` (a lookup, never a blocking wait: :meth:`close` joins this
        thread at once) and handle it."""
        try:
            store = self.store.clone()  # its own connection: nothing of the main thread's client is held here
        except (RuntimeError, AttributeError):  # a store that cannot be cloned (a FileStore) is shared
            store = self.store
        while not self._closed.wait(WATCH_POLL_S):
            epoch = self._epoch
            try:
                if not store.check([self._key(epoch, "posted")]):
                    continue
            except Exception:  # noqa: BLE001 - the job's store is gone: nothing will be posted
                continue
            self._handle(epoch, store)
            while self._epoch == epoch and not self._closed.is_set():  # the agreement bounds its own wait
                self._closed.wait(0.1)

    def _handle(self, epoch: int, store: Any) -> None:
        """A failure is posted: rank 0 records it; a rank that stays out of the agreement is stopped."""
        if self.rank == 0:
            self._record_posts(epoch, store)
        if self._reaches(epoch, self.stuck_after_s):
            return
        poster = store.get(self._key(epoch, "posted")).decode()
        logger.error(f"rank {self.rank}: still inside a step {self.stuck_after_s:g} s after rank {poster}'s step "
                     "raised; aborting its NCCL communicators")
        aborted = abort_nccl(live_groups())
        if aborted and self._reaches(epoch, ABORT_GRACE_S):
            return
        self._stop(epoch, store, poster, aborted > 0)

    def _reaches(self, epoch: int, within_s: float) -> bool:
        """Whether the main thread reaches the agreement of ``epoch`` (or is past it) within ``within_s``."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if self._at_agreement.is_set() or self._epoch != epoch or self._closed.is_set():
                return True
            time.sleep(0.05)
        return False

    def _stop(self, epoch: int, store: Any, poster: str, aborted: bool) -> None:
        """End this process: rank 0 records the cause and fails the trials it holds first."""
        then = (f", then {ABORT_GRACE_S:g} s after its NCCL communicators were aborted" if aborted
                else " (no NCCL communicator to abort)")
        line = (f"prefetch-planner: rank {self.rank} stopped: it stayed inside a step {self.stuck_after_s:g} s after "
                f"rank {poster}'s step raised ([launch] stuck_after_s){then}; the failure is recorded in the study")
        if self.rank == 0:
            self._record_posts(epoch, store, victims_too=True)
            with self._lock:
                if self._on_stop is not None:
                    try:
                        self._on_stop(f"not measured: rank {self.rank} was stopped after rank {poster}'s step raised")
                    except Exception as e:  # noqa: BLE001 - stopping is what is left
                        logger.warning(f"could not record the stopped trials: {e}")
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        os._exit(STOPPED_EXIT)

    def _record_posts(self, epoch: int, store: Any, victims_too: bool = False) -> None:
        """Rank 0: the first cause posted (a rank that failed by itself; a victim only with ``victims_too``)."""
        posts = []
        for r in range(self.world):
            key = self._key(epoch, "failure", r)
            if store.check([key]):
                posts.append((r, _failure(store.get(key))))
        causes = [(r, f) for r, f in posts if not f.victim] or (posts if victims_too else [])
        if causes:
            r, f = causes[0]
            self.record(epoch, f.plan, f"rank {r}: {f.error}")

    # -- keys --------------------------------------------------------------------------------------------------------

    def _key(self, epoch: int, what: str, rank: int | None = None) -> str:
        return f"{self.prefix}/{epoch}/{what}" + ("" if rank is None else f"/{rank}")

    def _check(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except Exception:  # noqa: BLE001 - a store that is gone holds nothing
            return False

    def _sequence(self) -> tuple[int, ...]:
        return tuple(collective_sequence(g) for g in live_groups() if g is not self.control)
