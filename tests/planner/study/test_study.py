"""The study driver without ranks: simulated stage, candidate choice, tell, queries."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from planner.errors import FailKind, StudyNotFoundError
from planner.simulation.parameters import simulator_for
from planner.storages import open_storage
from planner.study import (
    MeasuredStage,
    best_plan,
    distinct_plans,
    list_studies,
    plan_key,
    select_candidates,
    simulated_stage,
    study_trials,
)
from planner.study.earlier_jobs import EarlierJobs
from planner.study.records import Failure, MeasuredTrialRecord, SimulatedTrialRecord
from planner.testing import conclude_launches, run_round, study_config
from search_spaces import get_space


def _stage(config, storage, profile, job):
    return MeasuredStage(config, storage, simulator_for(profile), job, get_space(config.search.space))


@pytest.fixture
def config(tmp_path):
    return study_config(tmp_path, name="t", space="uniform", sim_trials=40, measured_trials=3)


def _run(make_profile, config, measured_ms, job="test"):
    """One ``tune`` job's round on exact step times, its survivor confirmed in one fresh launch at the ratio it
    raced at."""
    profile = make_profile(n_blocks=4, fwd=10.0, bwd=20.0, ag=8.0, rs=3.0)
    storage = open_storage(config.storage_url, config)
    sim = simulated_stage(
        simulator_for(profile), config, storage, get_space(config.search.space), show_progress_bar=False
    )
    candidates = select_candidates(sim, profile, get_space(config.search.space), config.search.measured_trials)
    stage = _stage(config, storage, profile, job)
    asked = stage.ask(candidates)
    plans_measured = run_round(stage, asked, measured_ms[: len(asked)], launches=1)
    stage.close()
    ratio = min(measured_ms[1:len(asked)]) / measured_ms[0]
    conclude_launches(config, job, ratio, 1, str(Path(config.storage_url.removeprefix("sqlite:///")).with_suffix(
        ".plan.json")))
    return profile, sim, candidates, plans_measured


def test_simulated_stage_enqueues_grid_and_ranks_candidates(make_profile, config):
    profile, sim, candidates, _ = _run(make_profile, config, [100.0, 90.0, 80.0, 95.0])
    assert len(sim.trials) == 40
    # FSDP2's default and the 48-point uniform grid come first (the first 40 of it here)
    assert sim.trials[0].params == {"forward_depth": 0, "backward_depth": 1, "unshard_async_op": False,
                                    "reshard_after_forward": True}
    assert len({tuple(sorted(t.params.items())) for t in sim.trials}) == 40
    assert candidates[0].plan.is_default_for(profile)
    assert len(candidates) == 4
    assert len({c.plan.behaviour_key() for c in candidates}) == 4
    rest = [c.predicted_ms for c in candidates[1:]]
    assert rest[0] == min(t.values[0] for t in sim.trials if t.values)  # the best (uniform) plan first
    kinds = [(c.plan.unshard_async_op, round(c.predicted_ms, 3)) for c in candidates[1:]]
    assert kinds[:2] == sorted(set(kinds), key=lambda k: k[1])[:2]  # then another kind before a near-copy


def test_tell_best_and_queries(make_profile, config):
    _, _, candidates, plans = _run(make_profile, config, [100.0, 90.0, 80.0, 95.0])
    assert [p.provenance.measured_ms for p in plans] == [100.0, 90.0, 80.0, 95.0]
    assert all(p.provenance.default_measured_ms == 100.0 for p in plans)
    recommended = best_plan(config.storage_url, "t")
    best = recommended.plan
    assert recommended.survivor is None and best.provenance.verdict == "faster"
    assert best.provenance.measured_ratio == 0.8
    assert best.provenance.measured_ms == 80.0 and recommended.recommendation.baseline_ms == 100.0
    assert best.behaviour_key() == candidates[2].plan.behaviour_key()
    [summary] = list_studies(config.storage_url)
    assert (summary.name, summary.measured_trial_count, summary.simulated_trial_count) == ("t", 4, 40)
    assert (summary.recommended_trial, summary.default_ms) == (best.provenance.trial, 100.0)
    c = summary.confirmation  # exact steps: the interval is the between-launch spread's alone, around 0.8
    assert c.ratio == pytest.approx(0.8) and c.ci95[0] < 0.8 < c.ci95[1] < 1
    assert c.within_ci95 == pytest.approx((0.8, 0.8), abs=1e-4)
    trials = study_trials(config.storage_url, "t")
    assert len(trials.measured) == 4 and len(trials.simulated) == 40
    assert all(isinstance(t, MeasuredTrialRecord) for t in trials.measured)
    assert all(isinstance(t, SimulatedTrialRecord) and t.predicted_peak_bytes > 0 for t in trials.simulated)
    # plain SQL answers without Python objects
    db = config.storage_url.removeprefix("sqlite:///")
    got = sqlite3.connect(db).execute(
        "select race_median_ms from planner_trials where study_name = 't' and is_default").fetchall()
    assert got == [(100.0,)]


def test_rerun_adds_trials_to_the_same_study(make_profile, config):
    _run(make_profile, config, [100.0, 90.0, 80.0, 95.0], job="first")
    _run(make_profile, config, [100.0, 70.0, 85.0, 99.0], job="second")
    [summary] = list_studies(config.storage_url)
    assert summary.measured_trial_count == 8 and summary.simulated_trial_count == 80
    assert best_plan(config.storage_url, "t").plan.provenance.measured_ms == 70.0  # the latest job decides


def test_failed_measurement_is_recorded(make_profile, config):
    profile = make_profile()
    storage = open_storage(config.storage_url, config)
    sim = simulated_stage(
        simulator_for(profile), config, storage, get_space(config.search.space), show_progress_bar=False
    )
    stage = _stage(config, storage, profile, "test")
    asked = stage.ask(select_candidates(sim, profile, get_space(config.search.space), 1))
    stage.fail(asked, Failure("RuntimeError: boom", FailKind.ERROR))
    stage.close()
    trials = stage.study.trials
    assert [t.state.name for t in trials] == ["FAIL", "FAIL"]
    assert MeasuredTrialRecord.from_trial(trials[0]).failure == Failure("RuntimeError: boom", FailKind.ERROR)
    with pytest.raises(StudyNotFoundError, match="no concluded tuning job"):
        best_plan(config.storage_url, "t")


def test_unknown_study_and_missing_db(make_profile, config, tmp_path):
    _run(make_profile, config, [100.0, 90.0, 80.0, 95.0])
    with pytest.raises(StudyNotFoundError, match="no study 'x'.*studies there: t"):
        best_plan(config.storage_url, "x")
    with pytest.raises(StudyNotFoundError, match="no database"):
        list_studies(f"sqlite:///{tmp_path}/none.db")
    assert not (tmp_path / "none.db").exists()


def test_a_second_job_skips_settled_plans(make_profile, config):
    """Measured, running (another job) and rank-failed plans are not measured again; the default always is."""
    profile = make_profile(n_blocks=4, fwd=10.0, bwd=20.0, ag=8.0, rs=3.0)
    storage = open_storage(config.storage_url, config)
    sim = simulated_stage(
        simulator_for(profile), config, storage, get_space(config.search.space), show_progress_bar=False
    )
    first = _stage(config, storage, profile, "a")
    asked = first.ask(select_candidates(sim, profile, get_space(config.search.space), 3,
                                        exclude=EarlierJobs(first).settled_keys()))
    run_round(first, asked[:2], [100.0, 90.0])  # default + one plan measured
    first.fail(asked[2:3], Failure("RuntimeError: boom", FailKind.ERROR))  # failed on a rank: not again
    # asked[3] stays RUNNING: job "a" is still measuring it
    second = _stage(config, storage, profile, "b")
    again = second.ask(
        select_candidates(sim, profile, get_space(config.search.space), 3, exclude=EarlierJobs(second).settled_keys())
    )
    keys_first = {a.plan.behaviour_key() for a in asked[1:]}
    assert again[0].plan.is_default_for(profile)
    assert not keys_first & {a.plan.behaviour_key() for a in again[1:]}
    assert len({a.number for a in asked} | {a.number for a in again}) == len(asked) + len(again)
    first.fail(asked[3:], Failure("KeyboardInterrupt: SIGINT", FailKind.INTERRUPTED))  # interrupted: measured again
    assert plan_key(asked[3].plan) not in EarlierJobs(second).settled_keys()
    assert plan_key(asked[2].plan) in EarlierJobs(second).settled_keys()
    for stage in (first, second):
        stage.close()


def _short_grace(make_profile, config):
    """A study whose trials go stale 2 s after their last heartbeat (1 s apart), retried once; its simulated stage
    run: ``(config, profile, storage, simulated study)``."""
    config = config.model_copy(update={"study": config.study.model_copy(
        update={"heartbeat_interval_s": 1, "grace_period_s": 2, "max_retry": 1})})
    profile = make_profile(n_blocks=4)
    storage = open_storage(config.storage_url, config)
    sim = simulated_stage(
        simulator_for(profile), config, storage, get_space(config.search.space), show_progress_bar=False
    )
    return config, profile, storage, sim


def test_a_trial_killed_before_its_first_heartbeat_is_failed_and_retried(make_profile, config, monkeypatch):
    """A job killed between creating its trials RUNNING and recording their first heartbeat (two transactions)
    leaves trials that Optuna's stale check skips, as it looks only at trials with a heartbeat: they stayed
    RUNNING for good (the likely cause of a CI failure of tests/runtime/ranks/test_cluster.py's SIGKILL test). The next
    job leaves them alone within grace_period_s (their job may be about to beat), then fails them and measures
    their plans again."""
    config, profile, storage, sim = _short_grace(make_profile, config)
    dead = _stage(config, storage, profile, "dead")
    monkeypatch.setattr(dead.heartbeat, "add", lambda trial_id: None)  # killed before the first beat
    asked = dead.ask(select_candidates(sim, profile, get_space(config.search.space), 1))
    dead.close()
    early = _stage(config, storage, profile, "early")
    assert not EarlierJobs(early).claim_retries()
    assert {early.study.trials[a.number].state.name for a in asked} == {"RUNNING"}
    early.close()
    time.sleep(2.5)
    job = _stage(config, storage, profile, "next")
    retries = EarlierJobs(job).claim_retries()
    assert sorted(r.retry_of for r in retries) == sorted(a.number for a in asked)
    assert {job.study.trials[a.number].state.name for a in asked} == {"FAIL"}
    run_round(job, retries, [100.0, 80.0])
    job.close()
    assert "RUNNING" not in {t.state.name for t in job.study.trials}


def test_stale_trial_is_failed_and_its_plan_retried(make_profile, config):
    """A job killed mid-trial: no heartbeat for grace_period_s, the next job fails it and measures it again."""
    config, profile, storage, sim = _short_grace(make_profile, config)
    dead = _stage(config, storage, profile, "dead")
    [default, other] = dead.ask(select_candidates(sim, profile, get_space(config.search.space), 1))
    run_round(dead, [default], [100.0])
    dead.close()  # the job dies: its heartbeat stops, `other` stays RUNNING
    time.sleep(3.5)
    job = _stage(config, storage, profile, "next")
    [retry] = EarlierJobs(job).claim_retries()
    assert retry.retry_of == other.number and retry.number != other.number
    assert retry.plan.behaviour_key() == other.plan.behaviour_key()
    assert job.study.trials[other.number].state.name == "FAIL"
    assert not EarlierJobs(_stage(config, storage, profile, "third")).claim_retries()  # claimed once only
    [baseline] = job.ask(
        select_candidates(sim, profile, get_space(config.search.space), 0)
    )  # every round has the default
    run_round(job, [baseline, retry], [100.0, 80.0])
    job.close()
    states = [t.state.name for t in job.study.trials]
    assert states.count("RUNNING") == 0 and states.count("COMPLETE") == 3  # two defaults and the retry
    assert best_plan(config.storage_url, "t").plan.provenance.trial == retry.number


def test_fail_held_leaves_no_trial_of_the_stage_running(make_profile, config):
    """A job that stops before its round was handed out (Ctrl-C during ask): its trials become FAIL."""
    profile = make_profile(n_blocks=4)
    storage = open_storage(config.storage_url, config)
    sim = simulated_stage(
        simulator_for(profile), config, storage, get_space(config.search.space), show_progress_bar=False
    )
    other = _stage(config, storage, profile, "other")
    [theirs] = other.ask(select_candidates(sim, profile, get_space(config.search.space), 0))
    stage = _stage(config, storage, profile, "stopping")
    asked = stage.ask(select_candidates(sim, profile, get_space(config.search.space), 2,
                                        exclude=EarlierJobs(stage).settled_keys()))
    run_round(stage, asked[:1], [100.0])
    failed = stage.fail_held("interrupted: KeyboardInterrupt: SIGINT")
    assert failed == [a.number for a in asked[1:]]
    trials = stage.study.trials
    assert trials[asked[0].number].state.name == "COMPLETE"
    for a in asked[1:]:
        assert MeasuredTrialRecord.from_trial(trials[a.number]).failure.kind == FailKind.INTERRUPTED
    assert trials[theirs.number].state.name == "RUNNING"  # another job's trial is not ours to fail
    assert stage.fail_held("again") == []
    for s in (stage, other):
        s.close()


def test_candidates_worth_racing(make_profile, tmp_path):
    """Per-module study: the best uniform plan is always raced; near-copies the model ties give way to the one
    keeping the least memory alive; plans of another kind in the band come before further near-copies."""
    from planner.study.candidates import _what_it_does

    profile = make_profile(n_blocks=5, fwd=10.0, bwd=20.0, ag=[8.0, 2.0, 12.0, 3.0, 9.0], rs=3.0, unsharded_bytes=1000)
    config = study_config(tmp_path, name="pm", space="per_module", sim_trials=150)
    storage = open_storage(config.storage_url, config)
    sim = simulated_stage(
        simulator_for(profile), config, storage, get_space(config.search.space), show_progress_bar=False
    )
    candidates = select_candidates(sim, profile, get_space("per_module"), 3)
    assert candidates[0].plan.is_default_for(profile)
    grid = [tuple(sorted(g.items())) for g in get_space("per_module").grid(profile)]
    uniform = [t for t in sim.trials if t.values and tuple(sorted(t.params.items())) in grid
               and t.params != get_space("per_module").grid(profile)[0]]
    best_uniform = min(uniform, key=lambda t: (t.values[0], t.number))
    assert candidates[1].params == best_uniform.params
    ranked = distinct_plans(sim, profile, get_space("per_module"))
    best_ms = min(t.values[0] for t, p in ranked if not p.is_default_for(profile))
    checked = 0
    for c in candidates[2:]:  # each in-band pick is the lowest-peak plan of its kind
        trial = next(t for t, _ in ranked if t.params == c.params)
        if trial.values[0] > best_ms * 1.05:
            continue  # a fill-in: fewer kinds than slots
        kind = [t for t, p in ranked if t.values[0] <= best_ms * 1.05
                and _what_it_does(t, p, best_ms) == _what_it_does(trial, c.plan, best_ms)]
        assert c.predicted_peak_bytes == min(SimulatedTrialRecord.from_trial(t).predicted_peak_bytes for t in kind)
        checked += 1
    assert checked >= 1
    assert len({c.plan.behaviour_key() for c in candidates}) == len(candidates)


def test_a_confirmation_is_stored_and_read_by_name_every_field_of_it():
    """Every :class:`Confirmation` field has its trial attribute (a field added there and not here fails), a full
    confirmation reads back equal, and an older one (no ``tau``, no ``noise_pct``) reads with the defaults."""
    import dataclasses
    import math

    from planner.statistics.verdict import Confirmation, Verdict
    from planner.study.records import CONFIRMATION_ATTRS, confirmation_attrs, confirmation_from

    assert list(CONFIRMATION_ATTRS)[-1] == "verdict"
    assert set(CONFIRMATION_ATTRS) == {f.name for f in dataclasses.fields(Confirmation)}
    full = Confirmation(ratio=0.9, ci95=(0.85, 0.95), rounds=24, noise_pct=3.0, verdict=Verdict.PROVISIONAL,
                        launches=3, median_ratio=0.91, tau=0.01, within_ci95=(0.88, 0.92), fresh=2, df=1.0,
                        level=0.02, floor=0.005, horizon=4)
    attrs = confirmation_attrs(full)
    assert list(attrs)[-1] == "verdict" and attrs["fresh_launches"] == 2 and attrs["ratio_ci95"] == [0.85, 0.95]
    assert confirmation_from(attrs) == full
    old = confirmation_from({"measured_ratio": 0.9, "ratio_ci95": [0.8, 1.0], "rounds": 6, "verdict": "faster"})
    assert old.tau is None and old.launches == 1 and math.isnan(old.noise_pct) and old.ci95 == (0.8, 1.0)


def test_a_half_written_trial_reads_without_its_confirmation():
    """Trials written before verdicts were stored apart hold their confirmation as attributes, which Optuna stored one
    at a time while another job read the study (``tests/runtime/ranks/test_cluster.py``): every prefix of such a
    trial's attributes reads, and a confirmation appears only whole. A trial written now carries none."""
    import optuna

    from planner.statistics.verdict import Confirmation, Verdict
    from planner.study.records import RaceMeasurements, confirmation_attrs

    full = MeasuredTrialRecord(predicted_ms=10.0, is_default=False, plan_key="k", job="j",
                               race=RaceMeasurements(4, 3.0, 0.9, None, True),
                               confirmation=Confirmation(0.9, (0.85, 0.95), 6, 3.0, Verdict.FASTER, 1))
    assert not set(confirmation_attrs(full.confirmation)) & set(full.to_user_attrs())
    items = list({**full.to_user_attrs(), **confirmation_attrs(full.confirmation)}.items())  # as they were written
    seen = []
    for n in range(len(items) + 1):
        trial = optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING, user_attrs=dict(items[:n]))
        record = MeasuredTrialRecord.from_trial(trial)
        assert record.confirmation in (None, full.confirmation)
        seen.append(record.confirmation is not None)
    assert seen[-1] and not seen[0] and seen == sorted(seen)  # absent until whole, then there to stay
