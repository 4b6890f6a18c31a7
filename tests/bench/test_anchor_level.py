"""bench.anchor_level: the anchor's level error, the rounds' levels, their autocorrelation, and an sd interval that
covers as often as it says."""

from __future__ import annotations

import json
import math
import random

import pytest
from click.testing import CliRunner

from bench.anchor_level import lag1_autocorrelation, main, round_levels, run_level, sd_interval, summary


def _run(tmp_path, name, anchor_ms, steps_ms, allocator=None, study="llama-cpu"):
    in_step = {"default_step_ms": anchor_ms, "allocator": allocator} if allocator else {"default_step_ms": anchor_ms}
    path = tmp_path / name
    path.write_text(json.dumps({"study": study, "profile": {"in_step": in_step, "measured_step_ms": 1.0},
                                "rows": [{"plan": f"p{i}", "steps_ms": s} for i, s in enumerate(steps_ms)]}))
    return path


def test_round_levels_take_out_each_plans_own_time():
    # two plans at 100 and 300 ms; the third round 10% slow for both, the first 5% fast for one only
    steps = [[95.0, 100.0, 110.0, 100.0], [300.0, 300.0, 330.0, 300.0]]
    levels = round_levels(steps)
    assert levels[2] == pytest.approx(1.1)
    assert levels[1] == pytest.approx(1.0) and levels[3] == pytest.approx(1.0)
    assert levels[0] == pytest.approx((0.95 + 1.0) / 2)
    with pytest.raises(ValueError, match="same number of rounds"):
        round_levels([[1.0, 2.0], [1.0]])


def test_the_level_error_is_the_anchor_over_the_defaults_median_in_the_rounds(tmp_path):
    run = run_level(_run(tmp_path, "a.json", 1150.0, [[1000.0, 980.0, 1020.0], [500.0, 490.0, 510.0]], "jemalloc"))
    assert run.level_error == pytest.approx(0.15)
    assert run.allocator == "jemalloc"
    # before the profile kept its allocator: named from the file or the study, and marked as inferred
    assert run_level(_run(tmp_path, "b-jemalloc-env.json", 1.0, [[1.0]])).allocator == "jemalloc?"
    named = run_level(_run(tmp_path, "c.json", 1.0, [[1.0]], study="llama-cpu-ac-full-jemalloc"))
    assert named.allocator == "jemalloc?"
    assert run_level(_run(tmp_path, "d.json", 1.0, [[1.0]])).allocator == "system?"


def test_lag1_autocorrelation_tells_a_drift_from_an_alternation(tmp_path):
    drifting = run_level(_run(tmp_path, "drift.json", 1.0, [[100.0 * 1.02**k for k in range(12)]]))
    alternating = run_level(_run(tmp_path, "alt.json", 1.0, [[100.0 * (1.05 if k % 2 else 0.95) for k in range(12)]]))
    assert lag1_autocorrelation([drifting]) > 0.7
    assert lag1_autocorrelation([alternating]) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="two rounds"):
        lag1_autocorrelation([run_level(_run(tmp_path, "one.json", 1.0, [[1.0]]))])


@pytest.mark.parametrize("n", [6, 10])
def test_the_sd_interval_covers_95_percent_of_normal_samples(n):
    """Simulated at the run counts the notes quote (6 jemalloc, 10 glibc runs): 4000 samples, so a 95% interval's
    coverage is within 1.5 points of 95% unless the interval is wrong (the binomial sd is 0.34 points)."""
    rng = random.Random(0)
    sigma, covered = 0.08, 0
    for _ in range(4000):
        _, lo, hi = sd_interval([rng.gauss(0.0, sigma) for _ in range(n)])
        covered += lo <= sigma <= hi
    assert abs(covered / 4000 - 0.95) < 0.015
    with pytest.raises(ValueError, match="2 values"):
        sd_interval([0.1])


def test_the_summary_groups_inferred_allocators_with_recorded_ones(tmp_path):
    runs = [run_level(_run(tmp_path, f"r{i}.json", 1000.0 * (1 + e), [[1000.0] * 3], "jemalloc" if i else None,
                           study="x-jemalloc")) for i, e in enumerate([0.02, -0.04, 0.12])]
    lines = summary(runs)
    assert len(lines) == 1 + 3 + 1 + 1
    line = next(x for x in lines if x.startswith("jemalloc:"))
    assert "3 runs (1 without one recorded)" in line and "median +2.0%" in line and "within 5% in 2" in line
    sd = math.sqrt(sum((e - 1 / 30) ** 2 for e in (0.02, -0.04, 0.12)) / 2)  # the sample sd, n - 1
    assert f"sd {100 * sd:.1f}%" in line
    assert lines[-1] == "lag-1 autocorrelation of the rounds' levels, pooled: nan"  # no round moved


def test_a_file_that_is_not_a_fidelity_run_is_one_line_and_exit_2(tmp_path):
    good = _run(tmp_path, "good.json", 1000.0, [[1000.0, 1010.0], [500.0, 505.0]], "jemalloc")
    bad = tmp_path / "trace.json"
    bad.write_text(json.dumps({"traceEvents": []}))
    result = CliRunner().invoke(main, [str(good), str(bad)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"error: {bad}: not a saved `bench.fidelity --json` run (KeyError: 'profile'); pass the runs under "
        "bench/results/fidelity-*.json"]
    assert CliRunner().invoke(main, [str(good)]).exit_code == 0
