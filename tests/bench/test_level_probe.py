"""bench.level_probe: window levels, their spread and their correlation with the step's, and saved runs read back."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from bench.level_probe import main, series_levels, window_levels


def test_window_levels_are_each_windows_median_over_the_series_median():
    # three windows of 10 s; the second runs 20% slow
    start = [0, 3, 6, 10, 13, 16, 20, 23, 26]
    values = [100, 102, 98, 120, 118, 122, 100, 100, 97]  # the run's median: 100
    assert window_levels(start, values, 10.0) == pytest.approx([1.0, 1.2, 1.0])


def test_a_short_last_window_joins_the_one_before():
    # the 30-32 s window holds one step, under half a window: its step joins the 20-30 s window
    start = [0, 5, 10, 15, 20, 25, 31]
    values = [100, 100, 100, 100, 90, 90, 200]
    assert window_levels(start, values, 10.0) == pytest.approx([1.0, 1.0, 0.9])
    # a last window over half full stands on its own
    assert len(window_levels([0, 5, 10, 15, 20, 25, 36], values, 10.0)) == 4


def test_window_levels_refuse_mismatched_or_empty_input():
    with pytest.raises(ValueError, match="one start per value"):
        window_levels([0, 1], [1.0], 1.0)
    with pytest.raises(ValueError, match="one start per value"):
        window_levels([], [], 1.0)
    with pytest.raises(ValueError, match="positive"):
        window_levels([0], [1.0], 0.0)


def _run(step, probe, flat):
    n = len(step)
    return {"study": "s", "allocator": "jemalloc", "window_s": 1.0, "start_s": [i + 0.5 for i in range(n)],
            "series": {"all_gather": probe, "step": step, "copy": flat}}


def test_a_probe_that_moves_with_the_step_correlates_and_a_flat_one_does_not():
    step = [100.0, 110.0, 130.0, 120.0, 100.0, 90.0]
    follows = [10 * s / 100 for s in step]
    flat = [5.0, 5.0, 5.0, 5.0, 5.0, 5.0]
    rows = series_levels(_run(step, follows, flat))
    assert [r.name for r in rows][0] == "step"  # the step first
    by_name = {r.name: r for r in rows}
    assert by_name["all_gather"].correlation_with_step == pytest.approx(1.0)
    assert by_name["all_gather"].sd == pytest.approx(by_name["step"].sd)
    assert by_name["copy"].sd == 0.0 and math.isnan(by_name["copy"].correlation_with_step)
    opposite = series_levels(_run(step, [20 - v for v in follows], flat))
    assert {r.name: r for r in opposite}["all_gather"].correlation_with_step < -0.99


def test_lag1_tells_a_drift_from_alternation():
    drift = series_levels(_run([100.0, 102.0, 104.0, 106.0, 108.0, 110.0], [1.0] * 6, [1.0] * 6))[0]
    alternate = series_levels(_run([100.0, 110.0, 100.0, 110.0, 100.0, 110.0], [1.0] * 6, [1.0] * 6))[0]
    assert drift.lag1 > 0.4
    assert alternate.lag1 < -0.6


def test_refit_reports_a_saved_run_and_refuses_another_file_in_one_line(tmp_path):
    good = tmp_path / "run.json"
    good.write_text(json.dumps(_run([100.0, 120.0, 100.0], [1.0, 1.2, 1.0], [2.0, 2.0, 2.0])))
    result = CliRunner().invoke(main, ["--refit", str(good)])
    assert result.exit_code == 0, result.output
    assert "all_gather" in result.output and "3 windows" in result.output
    bad = tmp_path / "fidelity.json"
    bad.write_text(json.dumps({"rows": []}))
    result = CliRunner().invoke(main, ["--refit", str(bad)])
    assert result.exit_code == 2
    assert "not a saved `bench.level_probe --json` run" in result.output and str(bad) in result.output
