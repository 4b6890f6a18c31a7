"""Finished trials written to an Optuna RDB study in one transaction: the simulated stage's bulk write.

``Study.add_trials`` on an RDB storage writes trial by trial, one ORM row and
one commit at a time, which dominates a large simulated study's wall time
(``python -m bench.simulator_speed`` times it). :func:`add_trials_bulk` writes the same rows with SQLAlchemy
Core ``executemany`` inserts, one transaction: trial numbers follow the
study's (under the study row's lock, as Optuna's ``_create_new_trial``
takes it, under a write lock that SQLite honours too), and the study stays Optuna's to read (``optuna.load_study``,
``optuna studies``, optuna-dashboard).

Optuna's table layout is private (``optuna.storages._rdb.models``); this
module is the one place that reaches it (the bulk write, and one query:
:func:`running_without_heartbeat`), and
``tests/planner/storages/test_bulk.py`` reads every field back through
Optuna, so an Optuna release that changes the layout fails that test loudly.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence

import optuna
import sqlalchemy as sa
from optuna.distributions import distribution_to_json
from optuna.storages._rdb import models  # private: the table layout (see the module docstring)
from optuna.trial import FrozenTrial


def add_trials_bulk(storage: optuna.storages.RDBStorage, study_name: str, trials: Sequence[FrozenTrial]) -> None:
    """Append finished ``trials`` to study ``study_name`` in one transaction.

    What ``optuna.Study.add_trials`` stores, without its per-trial commits:
    state, start and completion times, parameters with their distributions,
    values, user and system attributes (constraints included). Intermediate
    values are not written (a simulated trial has none).

    Args:
        storage: Optuna's RDB storage (``planner.storages.open_storage``).
        study_name: an existing study.
        trials: finished trials (COMPLETE, PRUNED or FAIL), e.g. an in-memory
            study's; their numbers are replaced by the study's next ones.

    Raises:
        ValueError: a trial is not finished.
        KeyError: no study named ``study_name``.
    """
    if any(not t.state.is_finished() for t in trials):
        raise ValueError("add_trials_bulk writes finished trials only (COMPLETE, PRUNED or FAIL)")
    if not trials:
        return
    study_id = storage.get_study_id_from_name(study_name)
    tables = {m.__tablename__: m.__table__ for m in (models.StudyModel, models.TrialModel, models.TrialParamModel,
                                                      models.TrialValueModel, models.TrialUserAttributeModel,
                                                      models.TrialSystemAttributeModel)}
    trial_t = tables["trials"]
    with storage.engine.begin() as conn:
        # The write lock first, then the count: a write that changes nothing takes the study row's lock on
        # PostgreSQL (what Optuna's ``_create_new_trial`` locks) and SQLite's database write lock, which a
        # SELECT ... FOR UPDATE does not (SQLite ignores it, and pysqlite opens the transaction only at the
        # first write). Counted before the lock, two jobs gave their trials the same numbers, and Optuna's
        # cached storage, which keys trials by number, showed only one of each pair.
        studies = tables["studies"]
        conn.execute(studies.update().where(studies.c.study_id == study_id).values(study_name=studies.c.study_name))
        first = conn.execute(sa.select(sa.func.count()).select_from(trial_t)
                             .where(trial_t.c.study_id == study_id)).scalar_one()
        conn.execute(trial_t.insert(), [
            {"number": first + i, "study_id": study_id, "state": t.state, "datetime_start": t.datetime_start,
             "datetime_complete": t.datetime_complete} for i, t in enumerate(trials)])
        ids = dict(conn.execute(sa.select(trial_t.c.number, trial_t.c.trial_id)
                                .where(trial_t.c.study_id == study_id, trial_t.c.number >= first)).all())
        params, values, user, system = [], [], [], []
        dist_json: dict[int, str] = {}
        for i, t in enumerate(trials):
            trial_id = ids[first + i]
            for name, value in t.params.items():
                d = t.distributions[name]
                text = dist_json.setdefault(id(d), distribution_to_json(d))
                params.append({"trial_id": trial_id, "param_name": name, "param_value": d.to_internal_repr(value),
                               "distribution_json": text})
            for objective, v in enumerate(t.values or ()):
                stored, kind = models.TrialValueModel.value_to_stored_repr(v)
                values.append({"trial_id": trial_id, "objective": objective, "value": stored, "value_type": kind})
            user += [{"trial_id": trial_id, "key": k, "value_json": json.dumps(v)} for k, v in t.user_attrs.items()]
            system += [{"trial_id": trial_id, "key": k, "value_json": json.dumps(v)}
                       for k, v in t.system_attrs.items()]
        for name, rows in (("trial_params", params), ("trial_values", values), ("trial_user_attributes", user),
                           ("trial_system_attributes", system)):
            if rows:
                conn.execute(tables[name].insert(), rows)



def running_without_heartbeat(storage: optuna.storages.RDBStorage, study_name: str, older_than_s: float) -> list[int]:
    """The storage trial ids of study ``study_name``'s RUNNING trials that have no heartbeat at all and started
    more than ``older_than_s`` seconds ago, ascending.

    Optuna's stale check (``RDBStorage._get_stale_trial_ids``) skips a trial that never beat: a job killed between
    creating a trial RUNNING and recording its first heartbeat (two transactions) leaves one that nothing fails.
    ``datetime_start`` is written with the writer's clock (``datetime.now()``), as here.
    """
    cutoff = datetime.datetime.now() - datetime.timedelta(seconds=older_than_s)
    trials, studies = models.TrialModel.__table__, models.StudyModel.__table__
    beats = models.TrialHeartbeatModel.__table__
    query = (sa.select(trials.c.trial_id)
             .join(studies, studies.c.study_id == trials.c.study_id)
             .outerjoin(beats, beats.c.trial_id == trials.c.trial_id)
             .where(studies.c.study_name == study_name, trials.c.state == optuna.trial.TrialState.RUNNING,
                    beats.c.trial_id.is_(None), trials.c.datetime_start < cutoff)
             .order_by(trials.c.trial_id))
    with storage.engine.connect() as conn:
        return [row[0] for row in conn.execute(query)]
