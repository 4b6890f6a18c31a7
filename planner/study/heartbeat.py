"""Optuna heartbeats for several RUNNING trials at once, from one daemon thread."""

from __future__ import annotations

import threading

import optuna


class Heartbeat:
    """Records Optuna heartbeats of the RUNNING trials it holds, every ``interval_s`` seconds.

    ``study.optimize`` runs such a thread for its one trial
    (``optuna.storages._heartbeat``); the measured stage holds several trials
    RUNNING at once through ask-and-tell, so it keeps its own, calling
    ``RDBStorage.record_heartbeat`` for each. A trial whose heartbeat stops
    for ``[study] grace_period_s`` is stale: the next job fails it and
    re-queues its plan.
    """

    def __init__(self, storage: optuna.storages.RDBStorage, interval_s: float):
        self.storage = storage
        self.interval_s = interval_s
        self._ids: set[int] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prefetch-planner-heartbeat", daemon=True)
        self._thread.start()

    def add(self, trial_id: int) -> None:
        """Hold ``trial_id`` (a storage trial id) and record its first heartbeat now."""
        with self._lock:  # held before the first beat, so an interrupt here still finds it (``fail_held``)
            self._ids.add(trial_id)
        self.storage.record_heartbeat(trial_id)

    def held(self) -> list[int]:
        """The trial ids held, ascending."""
        with self._lock:
            return sorted(self._ids)

    def discard(self, trial_id: int) -> None:
        """Stop beating for ``trial_id`` (told, failed, or taken over)."""
        with self._lock:
            self._ids.discard(trial_id)

    def stop(self) -> None:
        """End the thread (waits at most 5 s); trials still held go stale after the grace period."""
        self._stopped.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            for trial_id in self.held():
                try:
                    self.storage.record_heartbeat(trial_id)
                except Exception:  # noqa: BLE001 - a missed beat is retried next interval
                    pass
