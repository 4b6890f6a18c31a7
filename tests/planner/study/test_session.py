"""The tuning session's decisions, driven by synthetic step times (no ranks): budget, calibration, verdicts, retries."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time

import numpy as np
import optuna
import pytest

from planner.artifacts.plan import ModulePlan, Plan, Provenance, Source
from planner.errors import MemoryBudgetError, PlannerError, StorageError
from planner.simulation.simulator import SimParams
from planner.statistics.verdict import Verdict
from planner.study import study_trials
from planner.study.provenance import OBJECTIVE
from planner.study.records import MeasuredTrialRecord
from planner.study.session import TuningSession
from planner.testing import drive_round, drive_tune, study_config
from search_spaces import get_space


def _session(tmp_path, profile, name="t", job="test", **fields) -> TuningSession:
    config = study_config(tmp_path, name=name, **{"space": "uniform", "sim_trials": 48, "measured_trials": 2,
                                                  "max_rounds": 6, "confirm_min_rounds": 8, "confirm_max_rounds": 8,
                                                  **fields})
    return TuningSession(
        config,
        profile,
        get_space(config.search.space),
        job=job,
        plan_out=str(tmp_path / f"{name}.plan.json"),
        profile_out=str(tmp_path / f"{name}.profile.json"),
    )


@pytest.fixture
def profile(make_profile):
    return make_profile(n_blocks=4, fwd=10.0, bwd=20.0, ag=8.0, rs=3.0)


def _noisy(effects: dict[bool, float], pct: float, seed: int = 0):
    """Step times: 100 ms for FSDP2's default, ``100 * effects[False]`` for the others, times lognormal noise."""
    rng = np.random.default_rng(seed)
    return lambda i, trial: 100.0 * (1.0 if i == 0 else effects[False]) * float(np.exp(rng.normal(0, pct / 100)))


# --- the memory budget -------------------------------------------------------------------------------------------

def test_a_budget_below_every_plan_is_refused_before_the_storage_is_touched(tmp_path, profile):
    session = _session(tmp_path, profile, memory_budget="1KiB")
    with pytest.raises(MemoryBudgetError, match="below the smallest predicted peak of any plan"):
        session.prepare()
    assert not (tmp_path / "t.db").exists()


def test_a_relative_budget_needs_the_measured_default_peak(tmp_path, profile):
    session = _session(tmp_path, dataclasses.replace(profile, measured_peak_bytes=None), memory_budget="+10%")
    with pytest.raises(MemoryBudgetError, match="relative to FSDP2's default's measured peak"):
        session.prepare()
    assert not (tmp_path / "t.db").exists()


# --- verdicts and what is written ---------------------------------------------------------------------------------

def test_a_candidate_confirmed_faster_is_written(tmp_path, profile):
    """A lone candidate (the race picks nothing): its confirmation in this process is a fresh launch."""
    asked, outcome = drive_round(_session(tmp_path, profile, measured_trials=1), [100.0, 80.0])
    assert asked[0].plan.is_default_for(profile)  # the baseline comes first
    pv = outcome.candidate.provenance
    # no noise: the interval is the floor's between-launch spread alone, around the exact ratio
    assert (pv.verdict, pv.measured_ratio, pv.launches) == (Verdict.FASTER, pytest.approx(0.8), 1)
    assert pv.ratio_ci95[0] < 0.8 < pv.ratio_ci95[1] < 1.0 and pv.ratio_of == "total time"
    assert outcome.written == outcome.candidate and pv.trial == asked[1].number
    written = Plan.load(tmp_path / "t.plan.json")
    assert written.behaviour_key() == asked[1].plan.behaviour_key() and written.provenance.verdict == "faster"
    assert [p.provenance.measured_ms for p in outcome.plans_measured] == [100.0, 80.0]
    assert all(p.provenance.default_measured_ms == 100.0 for p in outcome.plans_measured)
    # Optuna's objective: the confirmed figure on the plan confirmed in this process, the race median elsewhere;
    # the trial says which, and the study's metric name (optuna-dashboard's label) names both
    records = {r.number: r for r in study_trials(f"sqlite:///{tmp_path}/t.db", "t").measured}
    confirmed = records[pv.trial]
    assert confirmed.objective == "confirmed" and confirmed.measured_ms == pytest.approx(100.0 * pv.measured_ratio)
    assert confirmed.race_ms == 80.0 and confirmed.confirm_launches[0].plan_ms == [80.0] * 8
    assert not confirmed.confirm_launches[0].picked
    assert [records[a.number].objective for a in asked if a.number != pv.trial] == ["race median"]
    study = optuna.load_study(study_name="t", storage=f"sqlite:///{tmp_path}/t.db")
    assert study.metric_names == [OBJECTIVE] and "confirmed" in OBJECTIVE and "race median" in OBJECTIVE


def test_a_verdict_and_the_figures_are_stored_once(tmp_path, profile):
    """The verdict in ``planner_confirmations``, beside the verdicts fresh launches reach: not on the trial, not in
    the stored plan; the prediction, race median and peaks on the trial, not in the stored plan. ``best_plan`` and
    ``read_trial`` put both back on the plan, as the plan file has them."""
    from planner.storages import open_storage
    from planner.storages.archive import confirmation_rows, stored_plan
    from planner.study import best_plan, read_trial

    asked, outcome = drive_round(_session(tmp_path, profile, measured_trials=1), [100.0, 80.0])
    trial, url = outcome.candidate.provenance.trial, f"sqlite:///{tmp_path}/t.db"
    storage = open_storage(url)
    rows, stored = confirmation_rows(storage.engine, "t"), stored_plan(storage.engine, "t", trial)
    storage.engine.dispose()
    launches, verdict = rows[trial]
    assert list(rows) == [trial] and len(launches) == 1 and verdict["verdict"] == "faster"
    attrs = optuna.load_study(study_name="t", storage=url).trials[trial].user_attrs
    assert not {"verdict", "measured_ratio", "ratio_ci95", "confirm_launches"} & set(attrs)
    assert stored.provenance.verdict is None and stored.provenance.measured_ratio is None
    figures = ("predicted_ms", "measured_ms", "default_measured_ms", "predicted_peak_bytes", "measured_peak_bytes")
    assert all(getattr(stored.provenance, f) is None for f in figures) and stored.provenance.trial == trial
    best = best_plan(url, "t").plan
    assert best == Plan.load(tmp_path / "t.plan.json") and best.provenance.verdict == "faster"
    pv, measured = best.provenance, outcome.candidate.provenance
    assert [getattr(pv, f) for f in figures] == [getattr(measured, f) for f in figures]
    assert (pv.measured_ms, pv.default_measured_ms) == (80.0, 100.0) and pv.predicted_ms == attrs["predicted_ms"]
    assert read_trial(url, "t", trial).plan == best


def test_a_plan_stored_by_an_older_release_keeps_the_figures_its_trial_lacks(profile):
    """Release 0.2.0 and earlier stored the figures in the plan too, and older trials lack some of them
    (``race_median_ms``, peaks): what the trial has wins, what it lacks stays as the plan has it."""
    from planner.study.provenance import as_measured, as_stored

    old = Plan.default(profile).with_provenance(trial=3, predicted_ms=90.0, measured_ms=101.0,
                                                default_measured_ms=100.0, measured_peak_bytes=7)
    record = MeasuredTrialRecord(number=3, measured_ms=99.0, predicted_ms=91.0)  # no race median, no peaks
    pv = as_measured(old, record, None).provenance
    assert (pv.predicted_ms, pv.measured_ms, pv.default_measured_ms, pv.measured_peak_bytes) == (91.0, 99.0, 100.0, 7)
    assert as_measured(as_stored(old), record, None).provenance.default_measured_ms is None


def test_a_trial_is_read_whole_in_one_call(tmp_path, profile):
    """``read_trial``: the record with its verdict, the plan as measured and the round's steps, each from the table
    that stores it; a trial the study lacks is one line naming the study and the command that lists its trials."""
    from planner.errors import StudyNotFoundError
    from planner.study import read_trial

    asked, outcome = drive_round(_session(tmp_path, profile, measured_trials=1), [100.0, 80.0], ranks=2)
    url, trial = f"sqlite:///{tmp_path}/t.db", outcome.candidate.provenance.trial
    view = read_trial(url, "t", trial)
    assert view.record.number == trial and view.record.confirmation.verdict == Verdict.FASTER
    assert view.plan.behaviour_key() == outcome.candidate.behaviour_key() and view.plan.provenance.trial == trial
    [steps] = view.steps
    assert len(steps.per_rank_ms) == 2 and float(np.median(steps.step_ms[:view.record.race.rounds])) == \
        pytest.approx(view.plan.provenance.measured_ms)
    baseline = read_trial(url, "t", asked[0].number)
    assert baseline.record.confirmation is None and baseline.plan.is_default_for(profile)
    with pytest.raises(StudyNotFoundError, match="study 't' has no trial 99; `prefetch-planner studies show t`"):
        read_trial(url, "t", 99)


def test_a_survivor_picked_among_candidates_is_provisional_in_its_own_process(tmp_path, profile):
    """Two candidates: the race picked the survivor in this process, so this process cannot call it faster
    ([Note: The race's own process]); FSDP2's default is written and the plan is pending, named on the last line."""
    asked, outcome = drive_round(_session(tmp_path, profile), [100.0, 80.0, 90.0])
    pv = outcome.candidate.provenance
    assert pv.verdict == Verdict.PROVISIONAL and pv.measured_ratio == pytest.approx(0.8)
    assert outcome.written.is_default_for(profile) and Plan.load(tmp_path / "t.plan.json").is_default_for(profile)
    assert outcome.best.keeps_baseline and outcome.best.recommendation.pending.number == pv.trial
    line = outcome.best.line("t")
    assert line.startswith("FSDP2's default, while") and "PROVISIONAL" in line and "fresh launch 1 of up to 3" in line
    records = {r.number: r for r in study_trials(f"sqlite:///{tmp_path}/t.db", "t").measured}
    assert records[pv.trial].confirm_launches[0].picked and records[pv.trial].confirmation.fresh == 0


@pytest.mark.parametrize(("step_ms", "candidates", "verdict"), [
    ([100.0, 130.0], 1, Verdict.SLOWER),  # a lone candidate, 4 rounds: too few to drop it; it is 30% slower
    (_noisy({False: 1.0}, pct=5.0), 2, Verdict.NO_SIGNIFICANT_DIFFERENCE),  # the same plan twice over, in noise
])
def test_a_survivor_not_confirmed_faster_leaves_fsdp2s_default_written(tmp_path, profile, step_ms, candidates,
                                                                        verdict):
    asked, outcome = drive_round(_session(tmp_path, profile, measured_trials=candidates), step_ms)
    assert outcome.candidate is not None and outcome.candidate.provenance.verdict == verdict
    assert outcome.written == outcome.plans_measured[0] and outcome.written.is_default_for(profile)
    assert Plan.load(tmp_path / "t.plan.json").is_default_for(profile)


def test_a_rounds_steps_are_stored_once_beside_the_plans_the_trials_keep_their_figures(tmp_path, profile):
    from planner.storages import open_storage
    from planner.storages.archive import measured_steps

    step_ms = [100.0, 80.0, 90.0]
    asked, outcome = drive_round(_session(tmp_path, profile), lambda i, trial: step_ms[i] + trial.number / 100, ranks=3)
    storage = open_storage(f"sqlite:///{tmp_path}/t.db")
    stored = {s.trial: s for s in measured_steps(storage.engine, "t")}
    storage.engine.dispose()
    assert sorted(stored) == sorted(a.number for a in asked)
    for i, a in enumerate(asked):
        steps = stored[a.number]
        assert len(steps.per_rank_ms) == 3 and steps.step_ms == [max(r) for r in zip(*steps.per_rank_ms, strict=True)]
        assert set(steps.step_ms) == {step_ms[i] + a.number / 100}
    records = {t.number: t for t in study_trials(f"sqlite:///{tmp_path}/t.db", "t").measured}
    trial = optuna.load_study(study_name="t", storage=f"sqlite:///{tmp_path}/t.db").trials[asked[1].number]
    assert not {"step_ms", "per_rank_step_ms"} & set(trial.user_attrs)  # the figures made from them, not the steps
    assert records[asked[1].number].race.median_ms == pytest.approx(80.0 + asked[1].number / 100)


def test_every_candidate_dropped_leaves_no_confirmation(tmp_path, profile):
    # the race's sign test needs 12 rounds of 3 plans to drop at alpha 5% (6 rounds, all slower: p = 1/64 x 2)
    asked, outcome = drive_round(_session(tmp_path, profile, max_rounds=12), _noisy({False: 1.5}, pct=2.0))
    assert set(outcome.race.dropped) == {1, 2} and outcome.race.survivor() is None
    assert outcome.candidate is None and outcome.written.is_default_for(profile)
    assert all(p.provenance.verdict is None for p in outcome.plans_measured)
    records = {t.number: t for t in study_trials(f"sqlite:///{tmp_path}/t.db", "t").measured}
    assert [records[a.number].race.dropped_after_round for a in asked] == [None, 12, 12]  # whole cycles of 3 plans


def test_the_round_starts_with_fsdp2s_default_and_tells_the_trials_it_started(tmp_path, profile):
    session = _session(tmp_path, profile)
    asked = session.prepare()
    with pytest.raises(PlannerError, match="starts with its baseline, FSDP2's default"):
        session.start(asked[1:])
    session.start(asked)
    with pytest.raises(PlannerError, match="tell the trials the round was started with"):
        session.tell(asked[:2], [[1.0], [1.0]], [[[1.0]], [[1.0]]])
    session.close()


# --- the plan the model arrived with ------------------------------------------------------------------------------

def _hand_set(profile) -> Plan:
    """A plan set by hand, as ``runtime.current_plan`` reads it back: forward prefetch depth 2, the last block kept
    unsharded after forward; no search-space parameters."""
    order = [f for f in profile.post_forward_order if f]
    modules = {fqn: ModulePlan(forward_prefetch=tuple(order[i + 1:i + 3]) if fqn else (),
                               reshard_after_forward=fqn not in ("", order[-1]))
               for i, fqn in [(order.index(f) if f else -1, f) for f in profile.fingerprint.module_fqns]}
    return Plan(fingerprint=profile.fingerprint, modules=modules, provenance=Provenance(source=Source.USER))


def _arrived_with(session: TuningSession, plan: Plan) -> TuningSession:
    session.user_plan = plan
    return session


def test_the_plan_the_model_arrived_with_is_the_baseline_and_kept_when_nothing_beats_it(tmp_path, profile):
    """[Note: The user's plan is the baseline]: the user's plan is raced first, FSDP2's default as a candidate; no
    plan confirmed faster than it, so the study recommends it and it is written back exactly."""
    own = _hand_set(profile)
    session = _arrived_with(_session(tmp_path, profile, measured_trials=1), own)
    asked, outcome = drive_round(session, lambda i, trial: 90.0 if trial.candidate.user_plan else 100.0)
    assert asked[0].candidate.user_plan and asked[0].plan == own and asked[1].plan.is_default_for(profile)
    assert len({a.plan.behaviour_key() for a in asked}) == len(asked)
    written = Plan.load(tmp_path / "t.plan.json")
    assert written.behaviour_key() == own.behaviour_key() and written.provenance.source == Source.USER
    assert outcome.best.keeps_baseline and outcome.best.baseline_name() == "the plan the model arrived with"
    assert outcome.best.line("t").startswith("the plan the model arrived with: ")
    assert all(p.provenance.baseline == "user" and p.provenance.default_measured_ms == 90.0
               for p in outcome.plans_measured)
    records = {r.number: r for r in study_trials(f"sqlite:///{tmp_path}/t.db", "t").measured}
    baseline, default = records[asked[0].number], records[asked[1].number]
    assert (baseline.user_plan, baseline.is_baseline, baseline.params) == (True, True, {})
    assert (default.is_default, default.is_baseline, default.user_plan) == (True, False, None)
    from click.testing import CliRunner

    from planner.presentation.cli import main

    url = f"sqlite:///{tmp_path}/t.db"
    shown = CliRunner().invoke(main, ["studies", "show", "t", "--storage", url])
    assert shown.exit_code == 0 and "yours (the plan the model arrived with), the baseline" in shown.output
    best = CliRunner().invoke(main, ["studies", "best", "t", "--storage", url])
    assert best.exit_code == 0 and "study t: the plan the model arrived with: " in best.output


def test_fsdp2s_default_confirmed_faster_than_the_users_plan_is_recommended(tmp_path, profile):
    """FSDP2's default is a candidate like the others: confirmed faster than the plan the model arrived with (its
    lone challenger: a fresh launch in this process), it is what the study recommends, the verdict against the
    user's plan."""
    session = _arrived_with(_session(tmp_path, profile, measured_trials=0), _hand_set(profile))
    asked, outcome = drive_round(session, [100.0, 80.0])
    pv = outcome.candidate.provenance
    assert asked[1].plan.is_default_for(profile) and pv.verdict == Verdict.FASTER
    assert pv.measured_ratio == pytest.approx(0.8) and pv.baseline == "user"
    assert not outcome.best.keeps_baseline and outcome.written.is_default_for(profile)
    assert "confirmed faster than the plan the model arrived with" in outcome.best.line("t")


def test_a_later_job_never_re_queues_another_jobs_user_plan(tmp_path, profile):
    """A dead job's user-plan trial is not rebuilt from parameters it does not have: the next job fails it and races
    the plan its own model arrived with."""
    fields = {"heartbeat_interval_s": 1, "grace_period_s": 2, "max_retry": 1, "measured_trials": 1}
    dead = _arrived_with(_session(tmp_path, profile, **fields), _hand_set(profile))
    dead.prepare()
    dead.close()
    time.sleep(3.5)
    session = _arrived_with(_session(tmp_path, profile, **fields), _hand_set(profile))
    asked, _ = drive_round(session, lambda i, trial: 100.0)
    assert asked[0].candidate.user_plan and asked[0].retry_of is None and sum(a.candidate.user_plan for a in asked) == 1
    states = [t.state.name for t in study_trials(f"sqlite:///{tmp_path}/t.db", "t").measured]
    assert states.count("RUNNING") == 0


def test_a_locked_study_in_the_simulated_stage_is_a_storage_error(tmp_path, profile, monkeypatch):
    """Optuna's own writes (the simulated stage's study) on a locked file: a one-line StorageError, not Optuna's
    StorageInternalError with a traceback."""
    drive_round(_session(tmp_path, profile), [100.0, 80.0, 90.0])
    monkeypatch.setenv("PREFETCH_PLANNER_SQLITE_TIMEOUT_S", "0.3")
    holder = sqlite3.connect(tmp_path / "t.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StorageError, match=r"held its write lock for (0\.[3-9]|1\.)\d* s"):
            _session(tmp_path, profile).prepare()
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_nothing_measured_writes_no_plan(tmp_path, profile):
    session = _session(tmp_path, profile)
    session.prepare()
    outcome = session.finish([], {})
    assert outcome.plans_measured == [] and outcome.written is None and outcome.race is None
    assert not (tmp_path / "t.plan.json").exists()
    session.save_profile()
    assert json.loads((tmp_path / "t.profile.json").read_text())["schema_version"] == 1
    session.close()


# --- calibration --------------------------------------------------------------------------------------------------

def test_an_accepted_calibration_is_saved_and_the_next_session_starts_from_it(tmp_path, profile):
    """Six measured plans, each 25% slower than predicted: a fit explains it; the next job of the study uses it."""
    first = _session(tmp_path, profile, measured_trials=5)
    _, outcome = drive_round(first, lambda i, trial: 1.25 * trial.candidate.predicted_ms)
    assert len(outcome.plans_measured) == 6 and outcome.calibration.accepted, outcome.calibration.reason
    assert outcome.profile.calibration is not None
    first.save_profile()
    assert json.loads((tmp_path / "t.profile.json").read_text())["calibration"] == outcome.profile.calibration

    again = _session(tmp_path, profile, measured_trials=5)
    again.prepare()
    assert again.profile.calibration == outcome.profile.calibration
    assert again.simulator.params == SimParams(**outcome.profile.calibration)
    first = outcome.plans_measured[0].provenance.predicted_ms
    assert again.simulator.run(Plan.default(profile)).step_ms == pytest.approx(1.25 * first, rel=0.02)
    again.close()
    other_model = _session(tmp_path, dataclasses.replace(profile, fingerprint=dataclasses.replace(
        profile.fingerprint, world_size=4)), measured_trials=5)
    other_model.prepare()
    assert other_model.profile.calibration is None  # made for another world size: not reused
    other_model.close()


def test_a_calibration_that_gains_nothing_is_not_saved(tmp_path, profile):
    """Measured as predicted: no fit beats the uncalibrated model, so none is kept for later jobs."""
    first = _session(tmp_path, profile, measured_trials=5)
    _, outcome = drive_round(first, lambda i, trial: trial.candidate.predicted_ms)
    assert not outcome.calibration.accepted and "does not beat" in outcome.calibration.reason
    assert outcome.profile.calibration is None
    again = _session(tmp_path, profile)
    again.prepare()
    assert again.profile.calibration is None
    again.close()


def test_too_few_measured_plans_are_not_fitted(tmp_path, profile):
    _, outcome = drive_round(_session(tmp_path, profile), [100.0, 80.0, 90.0])
    assert not outcome.calibration.accepted and outcome.calibration.reason.startswith("not fitted: 3 measured plans")


# --- a job that died ----------------------------------------------------------------------------------------------

def test_the_next_session_measures_again_what_a_dead_job_left_running(tmp_path, profile):
    fields = {"heartbeat_interval_s": 1, "grace_period_s": 2, "max_retry": 1}
    dead = _session(tmp_path, profile, **fields)
    left = dead.prepare()
    for a in left:  # as predicted on another profile
        dead.stage.storage.set_trial_user_attr(a.trial_id, "predicted_ms", 1.0)
    dead.close()  # the job dies: its heartbeat stops, its trials stay RUNNING
    time.sleep(3.5)
    asked, outcome = drive_round(_session(tmp_path, profile, **fields), lambda i, trial: 100.0 if i == 0 else 90.0)
    assert len(asked) == 5  # the dead job's default and two candidates, re-queued; two new candidates
    retried = [a for a in asked if a.retry_of is not None]
    assert sorted(a.retry_of for a in retried) == sorted(a.number for a in left)
    records = {t.number: t for t in study_trials(f"sqlite:///{tmp_path}/t.db", "t").measured}
    assert all(records[a.number].predicted_ms == a.candidate.predicted_ms != 1.0 for a in retried)  # this job's
    assert asked[0].plan.is_default_for(profile)  # the re-queued default is the baseline, not measured twice
    assert len({a.plan.behaviour_key() for a in asked}) == len(asked)
    states = [t.state.name for t in study_trials(f"sqlite:///{tmp_path}/t.db", "t").measured]
    assert states.count("RUNNING") == 0 and states.count("FAIL") == len(left)


def test_the_next_session_races_first_what_a_stopped_job_left_unmeasured(tmp_path, profile, make_profile):
    """A job that stopped (Ctrl-C, a lost node) failed its trials as interrupted; the next job races those plans in
    its round's first slots, though its own profile may rank others first, until a trial settles them; a plan
    interrupted more than ``max_retry + 1`` times is left to the search."""
    stopped = _session(tmp_path, profile, max_retry=1)
    left = stopped.prepare()[1:]
    stopped.fail_held("interrupted: RuntimeError: Connection reset by peer")
    stopped.close()
    keys = [a.plan.behaviour_key() for a in left]
    # the next job sees another profile: the model ranks other plans first
    faster_ag = make_profile(n_blocks=4, fwd=10.0, bwd=20.0, ag=1.0, rs=3.0)
    again = _session(tmp_path, faster_ag, max_retry=1, job="again")
    asked = again.prepare()
    assert asked[0].plan.is_default_for(faster_ag)
    assert sorted(a.plan.behaviour_key() for a in asked[1:]) == sorted(keys)  # the round's two slots
    again.fail_held("interrupted: KeyboardInterrupt: SIGINT")
    again.close()
    third = _session(tmp_path, faster_ag, max_retry=1, job="third")
    assert {a.plan.behaviour_key() for a in third.prepare()[1:]} == set(keys)  # interrupted twice: max_retry + 1
    third.fail_held("interrupted: KeyboardInterrupt: SIGINT")
    third.close()
    fourth = _session(tmp_path, faster_ag, max_retry=1, job="fourth")
    fourth.prepare()
    assert not fourth.earlier.interrupted(set())  # interrupted three times: left to the search
    fourth.close()
    fresh = _session(tmp_path, faster_ag, name="fresh")  # the same profile on a study without that history
    assert {a.plan.behaviour_key() for a in fresh.prepare()[1:]} != set(keys)
    fresh.close()


def test_a_plan_measured_since_its_interruption_is_not_raced_again(tmp_path, profile):
    stopped = _session(tmp_path, profile)
    left = stopped.prepare()[1:]
    stopped.fail_held("interrupted: KeyboardInterrupt: SIGINT")
    stopped.close()
    measured, _ = drive_round(_session(tmp_path, profile, job="measures"), [100.0, 90.0, 95.0])
    assert {a.plan.behaviour_key() for a in measured[1:]} == {a.plan.behaviour_key() for a in left}
    session = _session(tmp_path, profile, job="next")
    asked, _ = drive_round(session, lambda i, trial: 100.0 if i == 0 else 95.0)
    assert not session.earlier.interrupted(session.earlier.settled_keys())  # each such plan has a COMPLETE trial
    again = ({a.plan.behaviour_key() for a in asked if a.candidate.reconfirms is None}
             & {a.plan.behaviour_key() for a in left})
    assert not again  # only the recommendation, raced by every job, may be one of them


# --- the study's recommendation across jobs ------------------------------------------------------------------------

def _agree(tmp_path, profile, outcome) -> Plan:
    """``tune``'s last line, ``studies best`` and ``load_best_plan`` name one plan; returns it."""
    return _agree_best(tmp_path, profile, outcome.best)


def _agree_best(tmp_path, profile, written) -> Plan:
    """The recommendation a job wrote (``written``), ``studies best`` and ``load_best_plan`` name one plan, the one in
    the plan file; returns it."""
    from planner.study.queries import best_plan, best_plan_for

    url = f"sqlite:///{tmp_path}/t.db"
    best = best_plan(url, "t")
    loaded, why = best_plan_for(url, "t", profile.fingerprint)
    assert written.plan == best.plan == Plan.load(tmp_path / "t.plan.json")
    assert written.line("t") == best.line("t") == why
    assert (loaded is None) == best.keeps_baseline and (loaded is None or loaded == best.plan)
    return best.plan


def test_a_lucky_confirmation_is_raced_again_and_loses_the_recommendation(tmp_path, profile):
    """``tune``'s path. Job 1's candidates look 20% faster and its one fresh launch agrees (a confirmation that
    erred). Every later job races that plan again (``reconfirms``) with honest steps (every plan as fast as the
    default, 5% noise) and two fresh launches at the default's speed: none confirms it, so the study recommends
    FSDP2's default instead of keeping the luckiest of its confirmations."""
    url = f"sqlite:///{tmp_path}/t.db"
    _, _, first = drive_tune(_session(tmp_path, profile, job="j1"), lambda i, trial: 100.0 if i == 0 else 80.0,
                             ratio=0.8)
    lucky = first.recommendation.trial.number
    assert not first.keeps_baseline and _agree_best(tmp_path, profile, first).provenance.trial == lucky
    for k in (2, 3, 4):
        asked, _, best = drive_tune(_session(tmp_path, profile, job=f"j{k}"), _noisy({False: 1.0}, pct=5.0, seed=k),
                                    ratio=1.0, launches=2)
        records = {r.number: r for r in study_trials(url, "t").measured}
        reraced = [a.number for a in asked if records[a.number].reconfirms == lucky]
        assert len(reraced) == (1 if k == 2 else 0)  # from job 2 on the study recommends the default: none to race
        assert best.keeps_baseline and best.recommendation.pending is None
        assert _agree_best(tmp_path, profile, best).is_default_for(profile)
    records = study_trials(url, "t").measured
    assert sum(r.confirmation is not None for r in records) == 4  # every job's confirmation is kept


def test_a_plan_confirmed_again_keeps_the_recommendation(tmp_path, profile):
    _, _, first = drive_tune(_session(tmp_path, profile, job="j1"), lambda i, trial: 100.0 if i == 0 else 80.0,
                             ratio=0.8)
    holder = first.recommendation.trial.number
    asked, _, second = drive_tune(_session(tmp_path, profile, job="j2"), lambda i, trial: 100.0 if i == 0 else 80.0,
                                  ratio=0.8)
    again = second.plan.provenance
    assert again.verdict == Verdict.FASTER and again.trial == asked[1].number  # the holder, raced first, survives
    assert again.launches == 2  # the chain: job 1's launch and job 2's
    records = {r.number: r for r in study_trials(f"sqlite:///{tmp_path}/t.db", "t").measured}
    assert records[again.trial].reconfirms == holder
    assert _agree_best(tmp_path, profile, second).provenance.trial == again.trial


def test_a_provisional_plan_is_not_applied_until_a_fresh_launch_confirms_it(tmp_path, profile):
    """The in-loop path: the first process races two candidates and confirms its pick there: provisional, pending,
    FSDP2's default written. The next start races the pending plan alone (``reconfirms``), a fresh launch that
    confirms it faster: applied."""
    asked, first = drive_round(_session(tmp_path, profile, job="s1"), lambda i, trial: 100.0 if i == 0 else 80.0)
    pending = first.candidate.provenance.trial
    assert first.best.keeps_baseline and first.best.recommendation.pending.number == pending
    assert _agree(tmp_path, profile, first).is_default_for(profile)
    recheck = _session(tmp_path, profile, job="s2", measured_trials=0, sim_trials=0)
    asked, second = drive_round(recheck, lambda i, trial: 100.0 if i == 0 else 80.0)
    assert len(asked) == 2 and {r.reconfirms for r in study_trials(f"sqlite:///{tmp_path}/t.db", "t").measured
                                if r.number == asked[1].number} == {pending}
    c = second.candidate.provenance
    assert c.verdict == Verdict.FASTER and c.launches == 2  # the picked launch and the fresh one; only the fresh counts
    assert _agree(tmp_path, profile, second).provenance.trial == asked[1].number


def test_a_survivor_is_confirmed_in_fresh_launches_then_recommended(tmp_path, profile):
    """With ``confirm_launches``, the job leaves its survivor waiting (FSDP2's default written meanwhile); each
    launch appends its rounds; the conclusion is faster only if every launch is, and writes the recommendation."""
    from planner.study.confirmation import conclude, pending, record_launch
    from planner.study.records import ConfirmLaunch

    session = _session(tmp_path, profile, job="j1")
    session.confirm_launches = 2
    asked, outcome = drive_round(session, _noisy({False: 0.8}, pct=2.0))
    assert outcome.best is None and outcome.written.is_default_for(profile)
    waiting = pending(session.config, "j1")
    assert waiting.survivor.provenance.trial == outcome.candidate.provenance.trial and waiting.launches == 0
    assert waiting.rounds == 8 and waiting.baseline.is_default_for(profile)
    rng = np.random.default_rng(5)
    for launch in range(2):
        default = list(100.0 * np.exp(rng.normal(0, 0.02, waiting.rounds)))
        plan = [d * 0.8 * (1.0 + 0.01 * launch) for d in default]
        got = record_launch(session.config, waiting.survivor.provenance.trial, ConfirmLaunch(plan, default))
        assert got == launch + 1
    confirmation, best = conclude(session.config, "j1", str(tmp_path / "t.plan.json"))
    assert confirmation.launches == 2 and confirmation.rounds == 16 and confirmation.verdict == Verdict.FASTER
    assert confirmation.ratio == pytest.approx(0.804, abs=0.002)
    assert confirmation.ci95[0] < confirmation.ratio < confirmation.ci95[1] < 1
    assert best.plan.provenance.launches == 2 and pending(session.config, "j1") is None
    assert Plan.load(tmp_path / "t.plan.json") == best.plan


@pytest.mark.parametrize("launches, where", [(0, "in this process"), (2, "in each of 2 fresh launches"),
                                             (None, "in fresh launches, as many as the design chooses")])
def test_the_measured_stage_line_says_where_the_survivor_is_confirmed(tmp_path, profile, caplog, launches, where):
    """``tune``'s [3/3] line names where the confirmation runs: this process (``confirm_launches = 0``), a fixed
    number of fresh launches, or as many as the design chooses (``None``, the CLI's default), not this process."""
    session = _session(tmp_path, profile)
    session.confirm_launches = launches
    with caplog.at_level("INFO", logger="planner.study.session"):
        session.prepare()
    session.close()
    line = next(r.getMessage() for r in caplog.records if "[3/3] measured stage" in r.getMessage())
    assert f"fresh rounds {where}; trials" in line
