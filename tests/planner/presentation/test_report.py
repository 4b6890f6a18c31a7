"""What `prefetch-planner tune` prints at the end, from a job's outcome (no ranks)."""

from __future__ import annotations

from planner.artifacts.plan import Plan, Source
from planner.presentation.report import describe, tune_report
from planner.simulation.calibrate import CalibrationResult
from planner.statistics.race import Race
from planner.statistics.verdict import Confirmation, Verdict
from planner.study.queries import BestPlan
from planner.study.recommendation import JobVerdict, Recommendation
from planner.study.records import MeasuredTrialRecord
from planner.study.session import TuneOutcome
from planner.testing import synthetic_profile
from search_spaces import uniform


def _race(ms: dict[int, list[float]], dropped: dict[int, int]) -> Race:
    race = Race(len(ms))
    for k in range(max(len(v) for v in ms.values())):
        race.record({p: v[k] for p, v in ms.items() if k < len(v)})
    race.dropped.update(dropped)
    return race


def _outcome(verdict: str, ratio: float, ci: tuple[float, float]):
    p = synthetic_profile(n_blocks=3)
    base = {"source": Source.MEASURED, "study": "s", "default_measured_ms": 100.0}
    default = Plan.default(p).with_provenance(trial=0, predicted_ms=90.0, measured_ms=100.0, **base)
    tuned = uniform.build(p, 1, 2).with_knobs(unshard_async_op=True).with_provenance(
        trial=1, predicted_ms=70.0, measured_ms=80.0, verdict=verdict, measured_ratio=ratio, ratio_ci95=ci, rounds=12,
        noise_pct=6.5, launches=1, ratio_of="total time", **base)
    slow = uniform.build(p, 3, 3).with_provenance(trial=2, predicted_ms=95.0, measured_ms=130.0, **base)
    race = _race({0: [100.0, 104.0, 98.0, 101.0, 99.0, 100.0], 1: [80.0, 82.0, 79.0, 81.0, 80.0, 78.0],
                  2: [130.0, 128.0, 131.0, 129.0]}, {2: 4})
    written = tuned if verdict == "faster" else default  # only "faster" is applied
    calibration = CalibrationResult(
        None, None, None, 12.0, "not fitted: 3 measured plans, a fit needs at least 6"
    )
    within = (ratio * 0.98, ratio * 1.02) if verdict != "provisional" else (ratio - 0.02, 0.99)
    confirmation = Confirmation(ratio, ci, 12, 6.5, Verdict(verdict), 1, ratio, 0.045, within)
    job = JobVerdict("j", MeasuredTrialRecord(number=0, measured_ms=100.0),
                     MeasuredTrialRecord(number=1, confirmation=confirmation), last_trial=2)
    best = BestPlan(written, Recommendation(job.recommended or job.baseline, job),
                    None if written is tuned else tuned)
    return TuneOutcome(plans_measured=[default, tuned, slow], failed={3: "applying the plan failed on rank 1: boom"},
                       profile=p,
                       profile_out="s.profile.json", race=race, candidate=tuned, written=written,
                       plan_out="s.plan.json", calibration=calibration, best=best, confirmation=confirmation)


def test_report_of_a_faster_plan():
    lines = tune_report(_outcome("faster", 0.8, (0.78, 0.82)), "s")
    text = "\n".join(lines)
    assert lines[0] == "trial 3 FAIL: applying the plan failed on rank 1: boom"
    assert "FSDP2 default" in text and "forward prefetch 1, backward prefetch 2, async unshard True" in text
    assert "dropped after 4 rounds" in text
    assert "race: 6 rounds, noise" in text and "race ratio = median paired per-round ratio" in text
    assert "  race ms  race ratio" in text  # race figures are labelled as such
    assert ("confirmation: trial 1 vs FSDP2's default: total-time ratio 0.800, 95% CI [0.780, 0.820] over 12 fresh "
            "rounds in 1 launch: faster (median round 0.800, descriptive) (noise 6.5%)") in lines
    assert ("best plan: trial 1 of study 's', confirmed faster than FSDP2's default by job j: total-time ratio 0.800, "
            "95% CI [0.780, 0.820] over 12 fresh rounds in 1 launch; written to s.plan.json") in text
    power = "      power: 1 fresh launch(es) of 12 rounds call a total-time gain of"
    assert any(line.startswith(power) for line in lines)
    assert ("the simulator's fit to these 3 measured plans: not fitted: 3 measured plans, a fit needs at least 6; "
            "not saved") in lines
    assert lines[-1] == "profile written to s.profile.json"


def test_report_when_the_confirmation_cannot_tell():
    text = "\n".join(tune_report(_outcome("no significant difference", 0.98, (0.95, 1.01)), "s"))
    assert ("best plan: FSDP2's default: job j confirmed no plan faster (its survivor, trial 1: no significant "
            "difference, total-time ratio 0.980") in text
    # what the confirmation could have found, never a nudge to re-run it until it says "faster"
    assert "would find" not in text
    # the spread and the noise the power rests on, as these launches measured them
    assert "with 80% power at what these launches measured (between-launch spread 4.5%, noise " in text
    assert "% a round); the design's line above assumed the race's noise" in text


def test_report_of_a_provisional_plan():
    text = "\n".join(tune_report(_outcome("provisional", 0.95, (0.86, 1.05)), "s"))
    assert ("in 1 launch: provisional (within these launches 95% CI [0.930, 0.990]; not applied until it is faster "
            "across processes") in text
    assert ("best plan: FSDP2's default, while job j's survivor, trial 1, is PROVISIONAL: faster in its launches, not "
            "yet across processes") in text and "written to s.plan.json" in text
    assert "confirmed faster" not in text


def test_nothing_measured_writes_nothing():
    p = synthetic_profile()
    outcome = TuneOutcome(plans_measured=[], failed={}, profile=p, profile_out="p.json", plan_out="plan.json")
    assert tune_report(outcome, "s") == ["no plan was measured in this job; nothing written"]


def test_describe_names_depths_and_async():
    p = synthetic_profile(n_blocks=4)
    assert describe(Plan.default(p)) == "forward prefetch implicit, backward prefetch 1, async unshard False"
    assert describe(uniform.build(p, 3, 3)) == "forward prefetch 3, backward prefetch 3, async unshard False"


def test_describe_names_the_other_knobs_when_set():

    p = synthetic_profile(n_blocks=4)
    plan = uniform.build(p, 1, 1).with_knobs(unshard_async_op=True).with_knobs(separate_reduce_scatter_group=True,
                               reshard_after_backward=False)
    assert describe(plan) == ("forward prefetch 1, backward prefetch 1, async unshard True, no reshard after backward "
                              "between microbatches, reduce-scatter on its own process group")
