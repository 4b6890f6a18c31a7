"""planner.statistics.agreement: a re-measurement against a plan's claim ([Note: A claim checked against its
re-measurement]); the rate at which it disagrees with a true claim, and finds a false one, by simulation."""

from __future__ import annotations

import pytest

from planner.statistics.agreement import Agreement, compare_with_claim
from planner.statistics.verdict import Confirmation, Verdict, confirm_launches
from planner.testing.chains import LaunchModel, as_launches, at_most

RUNS = 1500


def _confirmation(ratio, ci95):
    return Confirmation(ratio, ci95, 24, 4.0, Verdict.FASTER, tau=0.045, within_ci95=ci95)


def test_a_re_measurement_within_the_claims_reach_agrees():
    check = compare_with_claim(_confirmation(0.82, (0.76, 0.88)), 0.80, (0.74, 0.86))
    assert check.agreement == Agreement.AGREES
    assert check.difference == pytest.approx(0.02)
    r, low, high = check.ratio_of_ratios
    assert r == pytest.approx(0.82 / 0.80) and low < r < high


def test_far_apart_with_tight_intervals_is_above_or_below():
    assert compare_with_claim(_confirmation(0.90, (0.89, 0.91)), 0.80, (0.79, 0.81)).agreement == Agreement.ABOVE
    assert compare_with_claim(_confirmation(0.70, (0.69, 0.71)), 0.80, (0.79, 0.81)).agreement == Agreement.BELOW


def test_no_claim_is_reported_not_tested():
    check = compare_with_claim(_confirmation(0.9, (0.8, 1.0)), None, None)
    assert check.agreement == Agreement.NO_CLAIM and check.difference is None and "no claim" in check.line()


def test_a_malformed_interval_is_refused():
    with pytest.raises(ValueError, match="0 < low <= high"):
        compare_with_claim(_confirmation(0.9, (0.8, 1.0)), 0.9, (1.0, 0.8))


def _disagreement_rate(claim: LaunchModel, verify: LaunchModel, seed: int) -> int:
    """Claims of 2 launches and re-measurements of 3, drawn independently; how many are not AGREES."""
    claims, verifications = claim.draw(RUNS, 2, seed), verify.draw(RUNS, 3, seed + 1000)
    events = 0
    for c, v in zip(claims, verifications, strict=True):
        claimed = confirm_launches(as_launches(c), 0.0)
        check = compare_with_claim(confirm_launches(as_launches(v), 0.0), claimed.ratio, claimed.ci95)
        events += check.agreement != Agreement.AGREES
    return events


@pytest.mark.parametrize("tau", [0.02, 0.045])
def test_a_true_claim_is_rarely_called_off(tau):
    """The same plan measured twice, processes differing by tau: 'disagrees' at most 5% (+3 standard errors)."""
    model = LaunchModel(gain=0.2, tau=tau)
    assert _disagreement_rate(model, model, seed=int(tau * 1000)) <= at_most(0.05, RUNS)


def test_a_claim_off_by_fifteen_points_is_found():
    """The user's process gains 5% where the claim's gained 20% (tau 0.02): found most of the time."""
    rate = _disagreement_rate(LaunchModel(gain=0.2, tau=0.02), LaunchModel(gain=0.05, tau=0.02), seed=7)
    assert rate >= 0.8 * RUNS
