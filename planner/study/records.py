"""What a trial of a study carries: one typed record per stage, the one place its attribute keys are written.

Optuna stores what a trial carries beyond its parameters and values as user
attributes (JSON values under string keys; optuna-dashboard and ``optuna
trials`` show them). Every writer builds a record with the fields it knows
and stores ``record.to_user_attrs()``; every reader takes
``Record.from_trial(trial)``. The keys are those databases already hold, so
studies written before these records read the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import optuna
from pydantic import JsonValue

from planner.artifacts.json_types import JsonObject
from planner.artifacts.names import SpaceName
from planner.errors import FailKind
from planner.statistics.launches import ConfirmLaunch
from planner.statistics.verdict import Confirmation, Verdict
from planner.study.search_space import TrialParams

# Optuna's own system attribute: the trial a re-queued stale trial retries (RetryFailedTrialCallback).
_RETRY_OF = "failed_trial"
# The memory budget as Optuna's constraint on a simulated trial (Trial.set_constraint: <= 0 is feasible).
PEAK_OVER_BUDGET = "peak_over_budget_bytes"


@dataclass(frozen=True)
class StudyRecord:
    """What a study (``NAME`` or ``NAME.sim``) carries: the search space its trials' parameters belong to."""

    space: SpaceName

    def to_user_attrs(self) -> JsonObject:
        """The study's user attributes."""
        return {"space": str(self.space)}


@dataclass(frozen=True)
class RaceMeasurements:
    """A measured plan in the race (``planner.statistics.race``).

    Attributes:
        rounds: rounds it ran.
        noise_pct: the race's step noise (IQR / median), %; ``None`` when too few steps.
        ratio: median per-round ratio to the race's baseline (FSDP2's default, or the plan the model arrived with);
            ``None`` for the baseline itself.
        dropped_after_round: rounds run when it was dropped; ``None``: it was not.
        survivor: the race kept it for the confirmation.
        median_ms: its median step in the race, ms (max across ranks); ``None`` on trials written before it was
            stored apart from the trial's value.
        ratio_sigma: on the survivor, the race's per-round log-ratio noise (``Race.ratio_sigma``), which sizes
            its confirmation; ``None`` elsewhere and on older trials.
    """

    rounds: int
    noise_pct: float | None = None
    ratio: float | None = None
    dropped_after_round: int | None = None
    survivor: bool = False
    median_ms: float | None = None
    ratio_sigma: float | None = None


@dataclass(frozen=True)
class Failure:
    """Why a measured trial is FAIL, and whether its plan is measured again (:class:`FailKind`)."""

    reason: str
    kind: FailKind


_CONFIRMATION_KEYS = ("measured_ratio", "ratio_ci95", "rounds")



def _attr() -> dataclasses.Field:
    """A :class:`MeasuredTrialRecord` field stored as the user attribute of its own name, as it is (JSON): the one
    declaration both ``to_user_attrs`` and ``from_trial`` read."""
    return dataclasses.field(default=None, metadata={"user_attr": True})


RACE_ATTRS = {"rounds": "race_rounds", "noise_pct": "race_noise_pct", "ratio": "race_ratio",
              "dropped_after_round": "dropped_after_round", "survivor": "race_survivor", "median_ms": "race_median_ms",
              "ratio_sigma": "race_ratio_sigma"}
"""Each :class:`RaceMeasurements` field's user attribute (``survivor`` stored only when true)."""


CONFIRMATION_ATTRS = {"ratio": "measured_ratio", "ci95": "ratio_ci95", "rounds": "rounds", "noise_pct": "noise_pct",
                      "launches": "launches", "median_ratio": "median_ratio", "tau": "tau",
                      "within_ci95": "within_ci95", "fresh": "fresh_launches", "df": "spread_df", "level": "look_level",
                      "floor": "spread_floor", "horizon": "chain_horizon", "verdict": "verdict"}
"""Each :class:`Confirmation` field's trial attribute, in the order they are written: the verdict last (Optuna
writes them in order; a reader takes a confirmation as whole once its verdict is there)."""


def confirmation_attrs(c: Confirmation) -> JsonObject:
    """A confirmation as trial attributes, by :data:`CONFIRMATION_ATTRS`, those not set left out (confirmations
    before the total-time estimand have no ``tau``: their ``measured_ratio`` is a median per-round ratio)."""
    values = {key: getattr(c, name) for name, key in CONFIRMATION_ATTRS.items()}
    return {key: list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Verdict) else v
            for key, v in values.items() if v is not None}


def confirmation_from(a: Mapping[str, JsonValue]) -> Confirmation:
    """The confirmation :func:`confirmation_attrs` wrote (or an older one: a field it lacks takes its default, and a
    missing ``noise_pct`` is NaN)."""
    values = {name: a[key] for name, key in CONFIRMATION_ATTRS.items() if key in a}
    values.setdefault("noise_pct", float("nan"))
    for name in ("ci95", "within_ci95"):
        if values.get(name) is not None:
            values[name] = tuple(values[name])
    return Confirmation(**{**values, "verdict": Verdict(a["verdict"])})


@dataclass(frozen=True, kw_only=True)
class MeasuredTrialRecord:
    """A trial of the measured study ``NAME``: one plan measured on the real ranks.

    A writer sets the fields it knows (the rest ``None``); :meth:`from_trial`
    fills every field the trial holds. Times in ms, sizes in bytes.

    Attributes:
        number, state, params: the trial's (set by :meth:`from_trial`).
        measured_ms: the trial's value (Optuna's objective): the plan's median step in the race (max across
            ranks), or for the plan confirmed in its job's process the confirmed figure (:attr:`objective`; the race
            median is then :attr:`race_ms`).
        retry_of: for a re-queued stale trial, the trial first failed.
        predicted_ms, predicted_peak_bytes: the simulator's, when asked.
        is_default: the plan is FSDP2's default.
        baseline: the plan is its job's baseline, what every verdict of the job compares against: FSDP2's default,
            or the plan the model arrived with (:attr:`user_plan`); ``None`` on trials written before baselines
            were stored (their baseline is FSDP2's default: :attr:`is_baseline`).
        user_plan: the plan is the one the model arrived with (``runtime.current_plan``), the job's baseline; it
            has no search-space parameters.
        plan_key: :func:`planner.study.candidates.plan_key` of the plan.
        job: the job that measured it.
        source: what measured it: ``"tune"`` (a tuning job's own steps) or ``"in-loop"`` (a user's training
            steps, ``runtime.AutoTuner``).
        race: the race's figures.
        confirmation: the confirmation against the job's baseline, on the plan it confirmed.
        confirm_rounds: rounds each confirmation launch runs (on the race's survivor, set when the race ends).
        confirm_planned: the fresh launches its confirmation's design asks for (on the race's survivor; ``None`` on
            trials written before designs: the study's ``confirm_launches``).
        confirm_launches: the launches measured so far (on the race's survivor).
        reconfirms: for the study's recommendation raced again by a later job, the trial it was recommended by.
        predicted_for: for a plan predicted for this cluster (``tune --target``) and raced here, its target.
        objective: which figure the trial's value is (``planner.study.provenance.OBJECTIVE``): ``"confirmed"`` or
            ``"race median"``.
        measured_peak_bytes: the measured peak per rank (max across ranks).
        failure: why it failed.
    """

    number: int | None = None
    state: optuna.trial.TrialState | None = None
    params: TrialParams = dataclasses.field(default_factory=dict)
    measured_ms: float | None = None
    retry_of: int | None = None
    predicted_ms: float | None = _attr()
    predicted_peak_bytes: int | None = _attr()
    is_default: bool | None = None
    baseline: bool | None = _attr()
    user_plan: bool | None = _attr()
    plan_key: str | None = _attr()
    job: str | None = _attr()
    source: str | None = _attr()
    race: RaceMeasurements | None = None
    confirmation: Confirmation | None = None
    confirm_rounds: int | None = _attr()
    confirm_planned: int | None = _attr()
    confirm_launches: list[ConfirmLaunch] | None = None
    reconfirms: int | None = _attr()
    predicted_for: str | None = _attr()
    objective: str | None = _attr()
    measured_peak_bytes: int | None = _attr()
    failure: Failure | None = None

    def to_user_attrs(self) -> JsonObject:
        """The set fields as Optuna user attributes (JSON values); trial number, state, parameters and value are
        Optuna's own and not among them, and so are the confirmation and its launches: they live in
        ``planner_confirmations`` (:meth:`confirmation_rows`), which a finished trial can still be given."""
        attrs = {"is_default": self.is_default, **{key: getattr(self, key) for key in _user_attr_fields()}}
        if self.race is not None:
            race = dataclasses.asdict(self.race) | {"survivor": self.race.survivor or None}
            attrs.update({key: race[name] for name, key in RACE_ATTRS.items()})
        if self.failure is not None:
            attrs.update(fail_reason=self.failure.reason, fail_kind=str(self.failure.kind))
        return {key: value for key, value in attrs.items() if value is not None}

    @classmethod
    def from_trial(cls, trial: optuna.trial.FrozenTrial) -> MeasuredTrialRecord:
        """The record of a stored trial (fields it does not hold are ``None``; its confirmation, stored apart, is
        :meth:`with_confirmation_rows`')."""
        a = trial.user_attrs
        race = None
        if "race_rounds" in a:
            race = RaceMeasurements(**{name: a.get(key) for name, key in RACE_ATTRS.items()})
            race = dataclasses.replace(race, survivor=bool(race.survivor))
        elif "dropped_after_round" in a:  # written before the race's rounds were
            race = RaceMeasurements(a["dropped_after_round"], dropped_after_round=a["dropped_after_round"])
        confirmation = None
        # Trials written before verdicts were stored apart hold the confirmation as attributes. Optuna stored them
        # one at a time, the verdict last: a reader may see a trial of another job half-written, so a confirmation
        # is read only once its verdict is there.
        if a.get("verdict") and all(k in a for k in _CONFIRMATION_KEYS):
            confirmation = confirmation_from(a)
        launches = a.get("confirm_launches")
        failure = (
            Failure(a["fail_reason"], FailKind(a.get("fail_kind", FailKind.ERROR))) if "fail_reason" in a else None
        )
        return cls(number=trial.number, state=trial.state, params=dict(trial.params), measured_ms=trial.value,
                   retry_of=trial.system_attrs.get(_RETRY_OF), is_default=bool(a.get("is_default")),
                   **{key: a.get(key) for key in _user_attr_fields()}, race=race, confirmation=confirmation,
                   confirm_launches=[ConfirmLaunch.from_json(x) for x in launches] if launches is not None else None,
                   failure=failure)

    def confirmation_rows(self) -> tuple[list[JsonObject], JsonObject | None]:
        """Its confirmation as ``planner_confirmations`` stores it: the launches' rounds, oldest first, and the
        verdict (:func:`confirmation_attrs`; ``None``: none reached)."""
        launches = [launch.to_json() for launch in self.confirm_launches or []]
        return launches, confirmation_attrs(self.confirmation) if self.confirmation is not None else None

    def with_confirmation_rows(self, launches: list[dict], confirmation: dict | None) -> MeasuredTrialRecord:
        """The record with its confirmation as ``planner_confirmations`` holds it
        (``planner.storages.archive.confirmation_rows``): the launches and the verdict. Trials written before
        verdicts were stored apart carry them as attributes instead (:meth:`from_trial` reads them)."""
        record = self
        if launches:
            record = dataclasses.replace(record, confirm_launches=[ConfirmLaunch.from_json(x) for x in launches])
        if confirmation is not None:
            record = dataclasses.replace(record, confirmation=confirmation_from(confirmation))
        return record

    @property
    def is_baseline(self) -> bool:
        """Whether the plan is its job's baseline (:attr:`baseline`; on older trials, FSDP2's default)."""
        return self.baseline if self.baseline is not None else bool(self.is_default)

    @property
    def race_ms(self) -> float | None:
        """The plan's median step in the race, ms: the trial's value unless it is the confirmed figure
        (:attr:`objective`)."""
        if self.race is not None and self.race.median_ms is not None:
            return self.race.median_ms
        return self.measured_ms

    @property
    def verdict(self) -> Verdict | None:
        """The confirmation's verdict, ``None`` if this plan was not the one confirmed."""
        return self.confirmation.verdict if self.confirmation is not None else None


def _user_attr_fields() -> tuple[str, ...]:
    """The :class:`MeasuredTrialRecord` fields stored as the user attribute of their own name (``_attr()``)."""
    return tuple(f.name for f in dataclasses.fields(MeasuredTrialRecord) if f.metadata.get("user_attr"))


@dataclass(frozen=True, kw_only=True)
class SimulatedTrialRecord:
    """A trial of the simulated study ``NAME.sim``: one plan predicted. Times in ms, sizes in bytes.

    Attributes:
        number, state, params: the trial's (set by :meth:`from_trial`).
        predicted_ms: objective 0, the predicted step.
        predicted_peak_bytes: objective 1, the predicted peak per rank (also a user attribute, ``peak_bytes``).
        exposed_comm_ms: the predicted step not covered by compute.
    """

    number: int | None = None
    state: optuna.trial.TrialState | None = None
    params: TrialParams = dataclasses.field(default_factory=dict)
    predicted_ms: float | None = None
    predicted_peak_bytes: int | None = None
    exposed_comm_ms: float | None = None

    def to_user_attrs(self) -> JsonObject:
        """The user attributes a simulated trial carries beside its two objective values."""
        return {"peak_bytes": self.predicted_peak_bytes, "exposed_comm_ms": self.exposed_comm_ms}

    @classmethod
    def from_trial(cls, trial: optuna.trial.FrozenTrial) -> SimulatedTrialRecord:
        """The record of a stored simulated trial."""
        a = trial.user_attrs
        peak = a.get("peak_bytes")
        return cls(number=trial.number, state=trial.state, params=dict(trial.params),
                   predicted_ms=trial.values[0] if trial.values else None,
                   predicted_peak_bytes=int(peak) if peak is not None else None,
                   exposed_comm_ms=a.get("exposed_comm_ms"))
