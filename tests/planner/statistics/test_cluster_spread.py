"""The cluster's own spread: the priors per device kind, the calibration's upper bound, the floor it sets, and the
power and error of the verdict on a calibrated cluster, by simulation through the product's own calibration
(``planner.study.cluster_spread.spread_of``), design and verdict (``planner.testing.chains.calibrated_chain``).

The chains: 12 rounds a launch, each plan's own step noise 1%, a calibration of 12 fresh launches over FSDP2's
default against a copy of itself and two unselected plans. Rates are held to their bound plus 3 standard errors,
powers to their target less 3.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import chi2

from planner.statistics.launches import (
    CALIBRATION_CONFIDENCE,
    DEFAULT_SPREAD,
    PRIORS,
    ConfirmLaunch,
    Spread,
    calibrate,
    launch_estimate,
    plan_spread,
    prior_for,
)
from planner.storages import open_storage
from planner.study.cluster_spread import (
    DEFAULT_PAIR,
    ClusterKey,
    calibration_pairs,
    cluster_spread,
    record_calibration_launch,
    spread_of,
    stored_clusters,
)
from planner.testing.chains import LaunchModel, as_launches, at_least, at_most, calibrated_chain

RUNS = 400
GPU = {"noise": 0.01, "rounds": 12}


def test_each_device_kind_has_a_prior_with_its_source():
    cpu, cuda = prior_for("cpu"), prior_for("cuda")
    assert cpu.spread == DEFAULT_SPREAD == Spread(0.045, 8.0) and cpu.measured
    assert cuda.spread.tau == 0.02 and not cuda.measured and "torchtitan" in cuda.source
    assert "not a measurement" in cuda.source
    assert prior_for("xpu") is PRIORS["cpu"]  # a device with no prior of its own takes the largest


def test_the_calibration_is_the_chi_square_upper_bound_on_the_pairs_launches():
    groups = [as_launches(c) for c in LaunchModel(tau=0.01, **GPU).draw(3, 4, seed=1)]
    estimates = [[launch_estimate(x.plan_ms, x.default_ms) for x in g] for g in groups]
    squares = sum(3 * np.var([e.log_ratio for e in g], ddof=1) for g in estimates)
    within = np.mean([e.variance for g in estimates for e in g])
    expected = math.sqrt(max(squares / chi2.ppf(1 - CALIBRATION_CONFIDENCE, 9) - within, 0.0))
    assert calibrate(estimates) == Spread(pytest.approx(expected), 9.0)
    with pytest.raises(ValueError, match="degrees of freedom"):
        calibrate(estimates[:1])


@pytest.mark.parametrize("tau", [0.005, 0.01, 0.02])
def test_the_calibrations_bound_covers_the_true_spread_90_percent_of_the_time(tau):
    covered = 0
    for c in LaunchModel(tau=tau, **GPU).draw(RUNS, 12, seed=int(1000 * tau)):
        launches = as_launches(c)
        groups = [[launch_estimate(x.plan_ms, x.default_ms) for x in launches[i::3]] for i in range(3)]
        covered += calibrate(groups).tau >= tau
    assert covered >= at_least(CALIBRATION_CONFIDENCE, RUNS)


def test_too_few_calibration_launches_keep_the_devices_prior():
    key = ClusterKey("cuda", "nccl", 16)
    launches = as_launches(LaunchModel(tau=0.01, **GPU).draw(1, 4, seed=2)[0])
    partial = spread_of(key, {DEFAULT_PAIR: launches[:2], "u0": launches[2:]})
    assert not partial.calibrated and partial.spread == prior_for("cuda").spread and "too few" in partial.source
    full = spread_of(key, {DEFAULT_PAIR: launches[:3] * 2, "u0": launches[1:] * 2})
    assert full.calibrated and full.spread.df == 10 and "calibrated on cuda/nccl, 16 ranks, FSDP" in full.source


def test_calibration_pairs_alternate_and_give_each_pair_two_launches():
    assert calibration_pairs(12, ["a", "b"]) == [DEFAULT_PAIR, "a", "b"] * 4
    assert calibration_pairs(2, ["a", "b"]) == [DEFAULT_PAIR, DEFAULT_PAIR]
    assert calibration_pairs(5, ["a"]) == [DEFAULT_PAIR, "a", DEFAULT_PAIR, "a", DEFAULT_PAIR]
    with pytest.raises(ValueError):
        calibration_pairs(1, [])


def test_the_calibration_is_stored_per_cluster_and_read_back(tmp_path):
    storage = open_storage(f"sqlite:///{tmp_path}/s.db")
    fsdp, hsdp = ClusterKey("cuda", "nccl", 8), ClusterKey("cuda", "nccl", 8, (2, 4))
    launches = as_launches(LaunchModel(tau=0.01, **GPU).draw(1, 12, seed=3)[0])
    for i, launch in enumerate(launches):
        record_calibration_launch(storage.engine, fsdp, calibration_pairs(12, ["u0"])[i], "a-study", launch)
    record_calibration_launch(storage.engine, hsdp, DEFAULT_PAIR, "a-study", launches[0])
    spread = cluster_spread(storage.engine, fsdp)
    assert spread.calibrated and spread.launches == 12 and spread.spread.df == 10
    assert spread.spread == calibrate([[launch_estimate(x.plan_ms, x.default_ms) for x in launches[i::2]]
                                       for i in range(2)])
    other = cluster_spread(storage.engine, hsdp)  # another mesh is another cluster: one launch, the prior
    assert not other.calibrated and other.launches == 1
    assert not cluster_spread(storage.engine, ClusterKey("cuda", "nccl", 16)).calibrated
    assert {s.key for s in stored_clusters(storage.engine)} == {fsdp, hsdp}
    with pytest.raises(ValueError):
        record_calibration_launch(storage.engine, fsdp, DEFAULT_PAIR, "a-study", ConfirmLaunch([1.0], [1.0]))


def test_a_study_that_agreed_does_not_lower_the_clusters_floor():
    """The study's evidence only raises the spread a verdict uses: pooled low, the floor (the calibration) stands;
    a plan whose own launches disagree raises it above."""
    floor = Spread(0.012, 10.0)
    agreed = floor.updated([[launch_estimate(x.plan_ms, x.default_ms) for x in as_launches(c)]
                            for c in LaunchModel(tau=0.001, **GPU).draw(60, 2, seed=4)])
    assert agreed.tau < floor.tau
    assert plan_spread(agreed, [], floor.tau).tau == floor.tau
    own = [launch_estimate(x.plan_ms, x.default_ms) for x in as_launches(LaunchModel(tau=0.08, **GPU).draw(1, 3, 5)[0])]
    used = plan_spread(floor, own, floor.tau)
    assert used.tau > floor.tau and used.df == 12


@pytest.mark.parametrize("launches", [0, None], ids=["in-loop chain", "tune"])
@pytest.mark.parametrize("tau", [0.005, 0.01, 0.02])
def test_on_a_calibrated_cluster_a_plan_with_nothing_to_gain_is_ever_faster_at_most_2_5_percent(tau, launches):
    ever, _, _ = calibrated_chain(LaunchModel(tau=tau, **GPU), RUNS, seed=int(1000 * tau), tune_launches=launches)
    assert ever <= at_most(0.025, RUNS)


@pytest.mark.parametrize("launches", [0, None], ids=["in-loop chain", "tune"])
def test_on_a_calibrated_cluster_gpu_sized_gains_are_confirmed(launches):
    """At a true spread of 1% between launches a 3% gain is confirmed faster within the chain at least 80% of the time,
    a 5% gain at least 95%; at 0.5% as well or better."""
    rates = {}
    for tau in (0.005, 0.01):
        for gain in (0.03, 0.05):
            ever, _, _ = calibrated_chain(LaunchModel(gain=gain, tau=tau, **GPU), RUNS, seed=int(1000 * tau),
                                          tune_launches=launches)
            rates[tau, gain] = ever
    assert rates[0.01, 0.03] >= at_least(0.8, RUNS) and rates[0.01, 0.05] >= at_least(0.95, RUNS)
    assert rates[0.005, 0.03] >= rates[0.01, 0.03] - 3 * math.sqrt(RUNS * 0.2 * 0.8)
    assert rates[0.005, 0.05] >= at_least(0.95, RUNS)
