"""The in-loop tuner's torch-free decisions: the study it runs, whether it tunes or reuses, its blocks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from planner.artifacts.fingerprint import Fingerprint
from planner.errors import StudyConfigError, StudyModelMismatchError
from planner.study.in_loop import (
    block_times,
    in_loop_config,
    plan_at_start,
    recheck_config,
    start_decision,
    step_orders,
)

MODEL = Fingerprint(("", "layers.0", "layers.1"), (10, 20, 20), (40, 80, 80), 2, "cpu", ("torch.float32",), "2.13.0")


def test_config_defaults_and_refusals(tmp_path):
    config = in_loop_config("job", f"sqlite:///{tmp_path}/s.db", "+10%", min_rounds=6)
    assert config.search.sim_timeout_s == 10.0 and config.measure.confirm_launches == 0
    assert config.measure.min_rounds == 6 and config.search.memory_budget == "+10%"
    assert in_loop_config("job", "sqlite://", sim_timeout_s=2.5).search.sim_timeout_s == 2.5
    with pytest.raises(StudyConfigError, match="confirm_launches = 2.*leave confirm_launches unset"):
        in_loop_config("job", "sqlite://", confirm_launches=2)
    with pytest.raises(StudyConfigError, match="unknown key 'min_round'"):
        in_loop_config("job", "sqlite://", min_round=6)
    with pytest.raises(StudyConfigError, match="'factory' is not a key here"):
        in_loop_config("job", "sqlite://", factory="x:y")


def test_start_decision():
    # a new study tunes
    assert start_decision("s", MODEL, [], False, False).tune
    # the same model, world size and torch with a concluded job: applied, no step spent (unless rechecked)
    reuse = start_decision("s", MODEL, [MODEL], True, False)
    assert not reuse.tune and "no step spent" in reuse.why
    recheck = start_decision("s", MODEL, [MODEL], True, True)
    assert recheck.tune and recheck.recheck and "no recording, no search" in recheck.why
    # a recheck of a study that recommends FSDP2's default has nothing to re-confirm: it tunes afresh
    afresh = start_decision("s", MODEL, [MODEL], True, True, recommends_baseline=True)
    assert afresh.tune and not afresh.recheck and "tuning afresh" in afresh.why
    # with no concluded job for this setup, recheck=True is a first tuning
    assert not start_decision("s", MODEL, [dataclasses.replace(MODEL, world_size=4)], True, True).recheck
    # recorded but never concluded: tune
    assert start_decision("s", MODEL, [MODEL], False, False).tune
    # another world size or torch: tune afresh, and say what changed
    for field, value, shown in (("world_size", 4, "world size 4 -> 2"), ("torch_version", "2.12.0", "torch 2.12.0")):
        other = dataclasses.replace(MODEL, **{field: value})
        decision = start_decision("s", MODEL, [other], True, False)
        assert decision.tune and shown in decision.why and "tuning afresh" in decision.why
    # another model: an error before any step
    bigger = dataclasses.replace(MODEL, param_numels=(10, 20, 30))
    with pytest.raises(StudyModelMismatchError, match="study 's' was tuned for another model.*'layers.1'"):
        start_decision("s", MODEL, [bigger], True, False)
    renamed = dataclasses.replace(MODEL, module_fqns=("", "blocks.0", "blocks.1"))
    with pytest.raises(StudyModelMismatchError, match="blocks.0"):
        start_decision("s", MODEL, [renamed], False, False)
    # a study holding this model among others is this model's
    assert not start_decision("s", MODEL, [bigger, MODEL], True, False).tune


def test_block_steps_and_times():
    block = [[0, 1, 2], [2, 0, 1]]
    assert step_orders(block) == [0, 1, 2, 2, 0, 1]
    assert block_times(block, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) == [{0: 1.0, 1: 2.0, 2: 3.0}, {2: 4.0, 0: 5.0, 1: 6.0}]
    with pytest.raises(ValueError, match="5 step times for a block of 6 steps"):
        block_times(block, [1.0] * 5)


def test_a_recheck_races_the_recommendation_alone_on_the_stored_profile(tmp_path, make_profile):
    """After a job that confirmed a plan 20% faster, ``recheck=True``: the study's latest profile of this job, and a
    session (``recheck_config``) that runs no simulated trial and asks FSDP2's default and the recommendation only;
    confirmed again, the recommendation stays."""
    from planner.study import study_trials
    from planner.study.queries import best_plan
    from planner.study.session import TuningSession
    from planner.testing import drive_round, drive_tune, study_config
    from search_spaces import get_space

    profile = make_profile(n_blocks=4, fwd=10.0, bwd=20.0, ag=8.0, rs=3.0)
    url = f"sqlite:///{tmp_path}/t.db"
    config = study_config(tmp_path, name="t", space="uniform", sim_trials=48, measured_trials=2, max_rounds=6,
                          confirm_min_rounds=8, confirm_max_rounds=8)

    def session(config, profile, job):
        return TuningSession(config, profile, get_space("uniform"), job=job, plan_out=str(tmp_path / "p.json"),
                             profile_out=str(tmp_path / "profile.json"))

    faster = lambda i, trial: 100.0 if i == 0 else 80.0  # noqa: E731
    _, first, _ = drive_tune(session(config, profile, "j1"), faster, ratio=0.8)  # tune: one fresh launch
    holder = first.candidate.provenance.trial
    assert not plan_at_start(config, profile.fingerprint).decision.tune  # reused, no step spent
    start = plan_at_start(config, profile.fingerprint, recheck=True)
    assert start.decision.recheck and start.profile.fingerprint == profile.fingerprint and start.plan is None

    rechecked = recheck_config(config)
    assert (rechecked.search.sim_trials, rechecked.search.measured_trials) == (0, 0)
    assert rechecked.measure == config.measure and rechecked.search.space == config.search.space
    simulated = len(study_trials(url, "t").simulated)
    asked, second = drive_round(session(rechecked, start.profile, "j2"), faster)
    records = {r.number: r for r in study_trials(url, "t").measured}
    assert len(asked) == 2 and asked[0].plan.is_default_for(profile) and records[asked[1].number].reconfirms == holder
    assert len(study_trials(url, "t").simulated) == simulated  # no simulated trial
    assert second.candidate.provenance.trial == asked[1].number
    assert best_plan(url, "t").plan.provenance.trial == asked[1].number


def _in_loop_session(tmp_path, config, profile, job):
    from planner.study.session import TuningSession
    from search_spaces import get_space

    return TuningSession(config, profile, get_space("uniform"), job=job, plan_out=str(tmp_path / "p.json"),
                         profile_out=str(tmp_path / "profile.json"))


@pytest.mark.parametrize("gain, verdicts", [(0.08, ["provisional", "faster"]),
                                            (0.04, ["provisional", "provisional", "no significant difference"])])
def test_a_provisional_recommendation_gathers_a_launch_at_every_start(tmp_path, make_profile, gain, verdicts):
    """The in-loop tuner's path across restarts, torch-free: each start is one launch (one process), a lone
    candidate so that every launch is fresh. A plan faster on its steps but not by enough to clear the spread
    between processes is provisional, not applied; every later start re-confirms it on a few steps (no recheck
    asked), pooling its rounds with the earlier launches at the level its earlier looks leave, until it is faster
    across processes (an 8% gain, at 2 launches) or, at 3 launches, the chain ends with FSDP2's default (4%)."""
    from planner.study import study_trials
    from planner.study.queries import best_plan
    from planner.testing import drive_round, study_config

    profile = make_profile(n_blocks=4, fwd=10.0, bwd=20.0, ag=8.0, rs=3.0)
    url = f"sqlite:///{tmp_path}/t.db"
    config = study_config(tmp_path, name="t", space="uniform", sim_trials=24, measured_trials=1, max_rounds=4,
                          confirm_min_rounds=12, confirm_max_rounds=12)
    rng = np.random.default_rng(3)
    steps = lambda i, trial: 100.0 * (1.0 if i == 0 else 1.0 - gain) * float(np.exp(rng.normal(0, 0.005)))  # noqa: E731
    _, outcome = drive_round(_in_loop_session(tmp_path, config, profile, "start-1"), steps)
    seen = [outcome.confirmation]
    for start in range(2, len(verdicts) + 1):
        decision = plan_at_start(config, profile.fingerprint)  # recheck=False: the start decides to re-confirm
        assert decision.decision.tune and decision.decision.recheck
        assert f"launch {start} of up to 3" in decision.decision.why
        _, outcome = drive_round(_in_loop_session(tmp_path, recheck_config(config), decision.profile,
                                                  f"start-{start}"), steps)
        seen.append(outcome.confirmation)
    assert [str(c.verdict) for c in seen] == verdicts
    assert [c.launches for c in seen] == list(range(1, len(verdicts) + 1))
    assert [c.rounds for c in seen] == [12 * k for k in range(1, len(verdicts) + 1)]
    best = best_plan(url, "t")
    line = best.line("t")
    assert f"in {len(verdicts)} launches" in line or best.keeps_baseline
    if verdicts[-1] == "faster":
        assert not best.keeps_baseline and "confirmed faster" in line
        assert not plan_at_start(config, profile.fingerprint).decision.tune  # settled: the next start spends no step
    else:
        assert best.keeps_baseline and "confirmed no plan faster" in line  # the default returns
    confirmed = [r for r in study_trials(url, "t").measured if r.confirmation is not None]
    assert [len(r.confirm_launches) for r in confirmed] == [1] * len(verdicts)  # each trial keeps its own launch
