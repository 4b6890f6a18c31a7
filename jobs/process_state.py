"""What a tuning rank has loaded before it records, so that ``prefetch-planner profile``'s ranks can load the same.

[Note: Record in tune's process state]
``tune``'s ranks have imported the tuning session (Optuna, SQLAlchemy, the simulator, the search spaces), the
measured rounds and the progress bar before they record. On CPU those imports move how much an async all-gather
hides in a step (``bench.ranks.as_tune_ranks``), so ``profile``'s ranks load them too before they record: a profile
recorded there then reads what ``tune`` would. ``tests/jobs/test_process_state.py`` checks that this list loads every
library ``jobs.tune`` loads beyond ``jobs.profile``.
"""

from __future__ import annotations

import importlib

TUNE_MODULES = (
    "tqdm",
    "tqdm.contrib.logging",
    "planner.storages",
    "planner.study.session",
    "runtime.measuring.measure",
    "runtime.measuring.round",
    "runtime.ranks.budget",
    "runtime.ranks.failures",
    "runtime.ranks.interrupts",
    "search_spaces.session",
)
"""The modules ``jobs.tune`` imports beyond what ``jobs.profile`` does (they bring Optuna and SQLAlchemy)."""


def load_tune_modules() -> None:
    """Import :data:`TUNE_MODULES` ([Note: Record in tune's process state])."""
    for name in TUNE_MODULES:
        importlib.import_module(name)
