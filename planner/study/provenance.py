"""What a measured round says of each plan: its provenance in the plan JSON and its trial's record.

Pure: built from the schedule (the race and the confirmation) and the
measured peaks, so the figures a plan file and a study carry are tested
without ranks or storage.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from planner.artifacts.plan import Plan, Source
from planner.statistics.schedule import Schedule
from planner.statistics.verdict import Confirmation
from planner.study.records import MeasuredTrialRecord, RaceMeasurements

# The measured study's objective name (optuna-dashboard's label) and the two figures a trial's value can be.
OBJECTIVE = "step_ms: confirmed (default's race median x total-time ratio) where confirmed in-process, else race median"
CONFIRMED, RACE_MEDIAN = "confirmed", "race median"


def provenance_of(confirmation: Confirmation) -> dict:
    """The :class:`~planner.artifacts.plan.Provenance` fields a confirmation fills in."""
    c = confirmation
    return dict(verdict=str(c.verdict), measured_ratio=c.ratio, ratio_ci95=tuple(c.ci95), rounds=c.rounds,
                launches=c.launches, noise_pct=c.noise_pct, ratio_of="total time" if c.total_time else None)


def with_confirmation(plan: Plan, confirmation: Confirmation | None) -> Plan:
    """``plan`` with ``confirmation``'s fields in its provenance (:func:`provenance_of`); ``None``: with none of
    them."""
    if confirmation is not None:
        return plan.with_provenance(**provenance_of(confirmation))
    return plan.with_provenance(**dict.fromkeys(_CONFIRMED_FIELDS))


_CONFIRMED_FIELDS = ("verdict", "measured_ratio", "ratio_ci95", "rounds", "launches", "noise_pct", "ratio_of")

# The provenance fields its trial stores (:func:`trial_figures`).
_TRIAL_FIGURES = ("predicted_ms", "measured_ms", "default_measured_ms", "predicted_peak_bytes", "measured_peak_bytes")


def as_stored(plan: Plan) -> Plan:
    """``plan`` as ``planner_plans`` keeps it: its trial named, but neither its verdict (``planner_confirmations``
    stores it) nor the figures its trial stores (:func:`trial_figures`). Each figure is stored once;
    :func:`as_measured` puts them back."""
    return with_confirmation(plan, None).with_provenance(**dict.fromkeys(_TRIAL_FIGURES))


def trial_figures(record: MeasuredTrialRecord, baseline: MeasuredTrialRecord | None) -> dict:
    """The provenance figures a measured trial stores (its prediction, race median and peaks; the race's baseline's
    median is its baseline trial's), those it lacks left out."""
    figures = dict(predicted_ms=record.predicted_ms, measured_ms=record.race_ms,
                   default_measured_ms=baseline.race_ms if baseline is not None else None,
                   predicted_peak_bytes=record.predicted_peak_bytes, measured_peak_bytes=record.measured_peak_bytes)
    return {key: value for key, value in figures.items() if value is not None}


def as_measured(stored: Plan, record: MeasuredTrialRecord, baseline: MeasuredTrialRecord | None) -> Plan:
    """A plan read from ``planner_plans`` with what its trial ``record`` stores put back: the figures
    (:func:`trial_figures`; ``baseline``: the trial of its race's baseline) and the verdict. A plan stored by
    release 0.2.0 and earlier kept its figures: a figure its trial lacks stays as the plan has it."""
    plan = stored.with_provenance(**trial_figures(record, baseline))
    return with_confirmation(plan, record.confirmation) if record.confirmation is not None else plan


@dataclass(frozen=True)
class MeasuredPlan:
    """One plan of a measured round.

    Attributes:
        plan: the plan, provenance filled in (trial, predicted and measured ms, the baseline's ms in the same
            race, peaks and budget, and the confirmation on the plan it confirmed).
        record: what its trial carries (:class:`MeasuredTrialRecord`).
        objective_ms: the trial's Optuna objective (:data:`OBJECTIVE`): for the plan confirmed here, the
            baseline's race median times the confirmed total-time ratio; for the others, the plan's race median.
    """

    plan: Plan
    record: MeasuredTrialRecord
    objective_ms: float


def measured_plans(
    study: str,
    trials: Sequence[tuple[int, Plan, float, int]],
    schedule: Schedule,
    peak_bytes: Sequence[int] | None = None,
    memory_budget_bytes: int | None = None,
    user_baseline: bool = False,
) -> list[MeasuredPlan]:
    """The round's plans with their figures, in the order the schedule ran them (the baseline first).

    Args:
        study: the measured study's name.
        trials: per plan, ``(trial number, plan, predicted ms, predicted peak bytes)``.
        schedule: the round's schedule, done.
        peak_bytes: per plan, the measured peak per rank, bytes; ``None``: not measured.
        memory_budget_bytes: the memory budget the plans were chosen under, bytes per rank.
        user_baseline: the first plan is the one the model arrived with ([Note: The user's plan is the baseline]
            in ``planner.study.session``): it keeps its source ``user``, and every plan's provenance names it as
            the baseline; else the first is FSDP2's default.
    """
    race, survivor, confirmation = schedule.race, schedule.survivor, schedule.confirmation
    default_ms = statistics.median(race.step_ms(race.default))
    noise = race.noise_pct()
    out = []
    for j, (number, plan, predicted_ms, predicted_peak) in enumerate(trials):
        figures = RaceMeasurements(
            rounds=len(race.step_ms(j)),
            noise_pct=noise if math.isfinite(noise) else None,
            ratio=math.exp(statistics.median(race.log_ratios(j, race.default))) if j != race.default else None,
            dropped_after_round=race.dropped.get(j),
            survivor=j == survivor,
            median_ms=statistics.median(race.step_ms(j)),
            ratio_sigma=_finite(race.ratio_sigma()) if j == survivor else None,
        )
        confirmed = confirmation if j == survivor else None
        peak = peak_bytes[j] if peak_bytes is not None and j < len(peak_bytes) else None
        pending = j == survivor and confirmed is None
        design = schedule.confirm_settings.design(race.ratio_sigma()) if pending else None
        launch = [schedule.confirm_launch()] if confirmed else None
        objective = CONFIRMED if confirmed is not None and confirmed.total_time else RACE_MEDIAN
        record = MeasuredTrialRecord(race=figures, confirmation=confirmed, measured_peak_bytes=peak,
                                     confirm_rounds=design.rounds if design else None,
                                     confirm_planned=design.launches if design else None, confirm_launches=launch,
                                     objective=objective)
        verdict = provenance_of(confirmed) if confirmed is not None else {}
        with_provenance = plan.with_provenance(
            source=Source.USER if user_baseline and j == race.default else Source.MEASURED,
            baseline="user" if user_baseline else None, study=study, trial=number, predicted_ms=predicted_ms,
            measured_ms=statistics.median(race.step_ms(j)), default_measured_ms=default_ms,
            predicted_peak_bytes=predicted_peak, measured_peak_bytes=peak, memory_budget_bytes=memory_budget_bytes,
            **verdict)
        median_ms = statistics.median(race.step_ms(j))
        objective_ms = default_ms * confirmed.ratio if objective == CONFIRMED else median_ms
        out.append(MeasuredPlan(with_provenance, record, objective_ms))
    return out


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
