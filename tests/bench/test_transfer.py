"""bench.transfer's summary and table: the mean verified-minus-claimed difference and its Student-t interval."""

import pytest

from bench.transfer import summary, table


def _row(claimed, verified, agreement="AGREES"):
    return {"workload": "w", "trial": 1, "source": "given", "claimed": claimed, "claimed_ci95": [0.7, 0.9],
            "claim_launches": 2, "verified": verified, "verified_ci95": [0.75, 0.95], "launch_ratios": [verified],
            "agreement": agreement}


def test_the_mean_difference_and_its_interval():
    rows = [_row(0.80, 0.81), _row(0.80, 0.83), _row(0.80, 0.85, "ABOVE")]
    s = summary(rows)
    assert s["mean_difference"] == pytest.approx(0.03)
    half = 4.302652729911275 * 0.02 / 3 ** 0.5  # t(0.975, 2) * sd / sqrt(n)
    assert s["ci95"] == pytest.approx((0.03 - half, 0.03 + half))
    assert s["agree"] == 2 and s["plans"] == 3


def test_one_plan_has_no_interval_and_the_table_has_a_row_a_plan():
    s = summary([_row(0.8, 0.9)])
    assert s["ci95"][0] != s["ci95"][0]  # nan: one plan gives no spread
    lines = table([_row(0.8, 0.9), _row(0.8, 0.7, "BELOW")])
    assert len(lines) == 4 and "+0.100" in lines[2] and "-0.100" in lines[3] and lines[3].endswith("below |")
