"""Forget a study: take back a recommendation that every later start would apply.

A study's recommendation is applied by every later start: ``AutoTuner`` reuses it without spending a step, and
``load_best_plan`` hands it to a training script. :func:`forget_study` removes the study from its storage, so the
next ``AutoTuner`` tunes afresh (the user's own plan the baseline again) and ``load_best_plan`` finds no study. To run
the user's own plan with no tuning at all, ``PREFETCH_PLANNER=off`` (:mod:`planner.switch`).

What goes: the measured study ``NAME``, its simulated stage ``NAME.sim`` and its predicted plans ``NAME.predicted``
(Optuna's ``delete_study``), and the planner's rows of those names (profiles, plans, measured runs, confirmations,
watches). What stays: the cluster's calibration launches (``planner_calibration_launches``), which are evidence of
the cluster's spread between launches, which every study on that cluster uses, not of this study's plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import optuna
import sqlalchemy as sa

from planner.storages.models import ConfirmationRow, MeasuredRunRow, PlanRow, ProfileRow, WatchRow
from planner.study.predicted import PREDICTED_SUFFIX
from planner.study.queries import load_study
from planner.study.simulated import SIM_SUFFIX

# children before parents: a measured run refers to its plan, a plan to its profile
_ROWS = (MeasuredRunRow, ConfirmationRow, WatchRow, PlanRow, ProfileRow)


@dataclass(frozen=True)
class Forgotten:
    """What :func:`forget_study` removed (or would remove).

    Attributes:
        name: the study.
        studies: the Optuna studies: ``NAME`` and those of ``NAME.sim``, ``NAME.predicted`` the storage holds.
        measured_trials: the measured study's trials.
        simulated_trials: the simulated stage's trials.
        rows: the planner's rows of those studies, by table.
    """

    name: str
    studies: tuple[str, ...]
    measured_trials: int
    simulated_trials: int
    rows: dict[str, int]

    def line(self, done: bool) -> str:
        """One line: what went (``done``) or would go."""
        rows = sum(self.rows.values())
        what = (f"study {self.name!r}: {self.measured_trials} measured and {self.simulated_trials} simulated trials, "
                f"{rows} rows of profiles, plans, runs, confirmations and watches")
        if not done:
            return f"{what} would be removed; pass --yes to remove them (the cluster's calibration launches stay)"
        return (f"forgot {what} (the cluster's calibration launches stay); the next start tunes afresh, or runs the "
                "model's own plan with PREFETCH_PLANNER=off")


def forget_study(url: str, name: str, dry_run: bool = False) -> Forgotten:
    """Remove study ``name`` from the storage at ``url`` (the module docstring says what goes and what stays), in
    one transaction for the planner's rows; ``dry_run``: remove nothing, say what would go.

    Raises:
        StudyNotFoundError: no database at ``url``, or no study ``name`` in it (the message lists those there).
        StorageError: the storage cannot be opened.
    """
    study, storage = load_study(url, name)
    all_names = set(optuna.get_all_study_names(storage))
    names = tuple(n for n in (name, name + SIM_SUFFIX, name + PREDICTED_SUFFIX) if n in all_names)
    simulated = (len(optuna.load_study(study_name=name + SIM_SUFFIX, storage=storage).trials)
                 if name + SIM_SUFFIX in names else 0)
    with storage.engine.begin() as conn:
        rows = {row.__tablename__: conn.execute(sa.select(sa.func.count()).select_from(row)
                                                .where(row.study_name.in_(names))).scalar_one() for row in _ROWS}
        if not dry_run:
            for row in _ROWS:
                conn.execute(sa.delete(row).where(row.study_name.in_(names)))
    forgotten = Forgotten(name, names, len(study.trials), simulated, rows)
    if not dry_run:
        for n in names:
            optuna.delete_study(study_name=n, storage=storage)
    storage.engine.dispose()
    return forgotten
