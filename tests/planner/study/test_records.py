"""planner.study.records: a measured trial's record is written and read through one declaration."""

from __future__ import annotations

import dataclasses

import optuna

from planner.errors import FailKind
from planner.study.records import RACE_ATTRS, Failure, MeasuredTrialRecord, RaceMeasurements


def test_every_field_a_record_writes_reads_back_the_same():
    plain = {f.name: f"x-{f.name}" for f in dataclasses.fields(MeasuredTrialRecord) if f.metadata.get("user_attr")}
    record = MeasuredTrialRecord(is_default=True, race=RaceMeasurements(6, 2.5, 0.97, 4, True, 101.5, 0.03),
                                 failure=Failure("boom", FailKind.INTERRUPTED), **plain)
    attrs = record.to_user_attrs()
    assert set(plain) <= set(attrs) and set(RACE_ATTRS.values()) <= set(attrs)
    trial = optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL, user_attrs=attrs)
    back = MeasuredTrialRecord.from_trial(trial)
    assert dataclasses.replace(back, number=None, state=None) == record
    # a race that did not keep the plan stores no survivor attribute, and reads back False
    quiet = MeasuredTrialRecord(race=RaceMeasurements(3)).to_user_attrs()
    assert quiet == {"race_rounds": 3}
    assert MeasuredTrialRecord.from_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL,
                                                                    user_attrs=quiet)).race == RaceMeasurements(3)
