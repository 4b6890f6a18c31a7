"""What `prefetch-planner tune` prints at the end, from a job's outcome (no ranks)."""

from __future__ import annotations

from jobs.report import describe, tune_report
from jobs.tune import Calibration, TuneOutcome
from planner.plan import Plan, Source
from planner.testing import synthetic_profile
from search_spaces import uniform


def _measured(plan: Plan, trial: int, ms: float) -> Plan:
    return plan.with_provenance(source=Source.MEASURED, study="s", trial=trial, predicted_ms=ms - 10.0,
                                measured_ms=ms, default_measured_ms=100.0)


def test_report_lists_the_round_and_names_the_files():
    p = synthetic_profile(n_blocks=3)
    default, tuned = _measured(Plan.default(p), 0, 100.0), _measured(uniform.build(p, 1, 2, True), 1, 80.0)
    outcome = TuneOutcome(told=[default, tuned], failed={2: "applying the plan failed on rank 1: boom"}, profile=p,
                          profile_out="s.profile.json", best=tuned, plan_out="s.plan.json", study_best=tuned,
                          calibration=Calibration(before_pct=[-20.0, -10.0], after_pct=[1.0, -2.0]))
    lines = tune_report(outcome, "s")
    assert lines[0] == "trial 2 FAIL: applying the plan failed on rank 1: boom"
    table = "\n".join(lines)
    assert "FSDP2 default" in table and "forward prefetch 1, backward prefetch 2, async unshard True" in table
    assert "\nbest plan: trial 1, 80.0 ms vs FSDP2 default 100.0 ms (ratio 0.800); written to s.plan.json" in lines
    assert "study-wide best so far: trial 1, 80.0 ms (`prefetch-planner studies best s`)" in lines
    assert any(line.startswith("calibration on these 2 measured plans: median |error| 15.0%, max 20.0% before, "
                               "median |error| 1.5%, max 2.0% after") for line in lines)
    assert lines[-1] == "profile written to s.profile.json"


def test_nothing_measured_writes_nothing():
    p = synthetic_profile()
    outcome = TuneOutcome([], {}, p, "p.json", None, "plan.json", None, None)
    assert tune_report(outcome, "s") == ["no plan was measured in this job; nothing written"]


def test_describe_names_depths_and_async():
    p = synthetic_profile(n_blocks=4)
    assert describe(Plan.default(p)) == "forward prefetch implicit, backward prefetch 1, async unshard False"
    assert describe(uniform.build(p, 3, 3, False)) == "forward prefetch 3, backward prefetch 3, async unshard False"
