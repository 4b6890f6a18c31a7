"""The tune job's progress on rank 0: the measured bar is drawn from the first measured step, and the jobs' log lines
never land on it (the simulated stage's lines used to follow ``measured: 0step`` on the same terminal line)."""

from __future__ import annotations

import logging
import math
import random
from itertools import pairwise
from types import SimpleNamespace

import pytest

import jobs.tune as tune_module
from jobs import PROGRESS_LOGGERS
from jobs.launching import log_rank0_progress
from jobs.tune import TuneJob
from planner.statistics.race import RaceSettings
from planner.statistics.schedule import Schedule


@pytest.fixture
def rank0_logging(monkeypatch):
    """Installs the progress loggers as ``jobs.cli`` sets them on rank 0 (stdout, INFO) when called in a test, where
    stdout is the test's capture; restores them afterwards."""
    loggers = [logging.getLogger(name) for name in PROGRESS_LOGGERS]
    saved = [(lg.handlers, lg.level, lg.propagate) for lg in loggers]
    monkeypatch.setenv("RANK", "0")
    yield log_rank0_progress
    for lg, (handlers, level, propagate) in zip(loggers, saved, strict=True):
        lg.handlers, lg.propagate = handlers, propagate
        lg.setLevel(level)


def _job(progress: bool) -> TuneJob:
    config = SimpleNamespace(measure=SimpleNamespace(warmup_steps=1))
    return TuneJob(config, plan_out="unused.plan.json", profile_out="unused.profile.json", progress=progress)


def _round_that_logs(capsys, seen: dict):
    """A measured round: the simulated stage logs, three steps are measured, the race logs its table."""

    def measured_round(workload, session, warmup_steps, group, on_step, on_warm_up, board):
        logging.getLogger("planner.study.session").info("[2/3] simulated stage: 30 trials")
        seen["before the first step"] = capsys.readouterr()
        for _ in range(3):
            if on_step is not None:
                on_step()
        logging.getLogger("planner.study.session").info("race: 3 rounds")
        return "round result"

    return measured_round


def test_the_measured_bar_is_drawn_from_the_first_step_and_log_lines_stay_whole(monkeypatch, capsys, rank0_logging):
    rank0_logging()
    seen = {}
    monkeypatch.setattr(tune_module, "measured_round", _round_that_logs(capsys, seen))
    assert _job(progress=True)._measure(workload=None, group=None, rank0=True, board=None) == "round result"
    after = capsys.readouterr()

    before = seen["before the first step"]
    assert before.err == ""  # no bar yet while the simulated stage logs
    assert before.out == "[2/3] simulated stage: 30 trials\n"
    assert "measured" in after.err and "3step" in after.err  # drawn, and counted every step
    assert after.out.endswith("race: 3 rounds\n")  # written through tqdm.write, a whole line of its own
    assert "\nrace: 3 rounds\n" in "\n" + after.out


@pytest.mark.parametrize("progress, rank0", [(False, True), (True, False)])
def test_no_bar_without_progress_or_off_rank0(monkeypatch, capsys, rank0_logging, progress, rank0):
    rank0_logging()
    seen = {}
    monkeypatch.setattr(tune_module, "measured_round", _round_that_logs(capsys, seen))
    _job(progress=progress)._measure(workload=None, group=None, rank0=rank0, board=None)
    after = capsys.readouterr()

    assert seen["before the first step"].err == "" and after.err == ""
    assert after.out == "race: 3 rounds\n"


def _round_on_a_schedule(job: TuneJob, seen: list, descriptions: set):
    """A measured round of 4 plans on a real schedule (plan 3 far slower, so the race drops it, at 12 of its 24
    rounds: the sign test's first chance at this alpha; then the confirmation in-process): 2 warm-up steps a plan
    before the schedule exists, announced, then its blocks. ``seen``: (n, total) after each step; ``descriptions``:
    the bar's descriptions in the warm-up."""

    def measured_round(workload, session, warmup_steps, group, on_step, on_warm_up, board):
        schedule = Schedule(4, RaceSettings(max_rounds=24), clock=lambda: 0.0)
        rng = random.Random(0)
        on_warm_up(2 * 4)
        for _ in range(2 * 4):
            on_step()
            seen.append((job._bar.n, job._bar.total))
            descriptions.add(job._bar.desc)
        job.session = SimpleNamespace(schedule=schedule)
        while (block := schedule.next_block()) is not None:
            times = []
            for order in block:
                ms = {}
                for plan in order:
                    ms[plan] = (130.0 if plan == 3 else 100.0) * math.exp(rng.gauss(0, 0.01))
                    on_step()
                    seen.append((job._bar.n, job._bar.total))
                times.append(ms)
            schedule.record(times)
        return schedule

    return measured_round


def test_the_measured_bar_total_holds_within_a_block_and_ends_full(monkeypatch, capsys, rank0_logging):
    """The total is the warm-up's steps, as the round announces them, until the schedule exists; then it is set from
    the schedule at each block's first step: it never grows as steps run (it did, by one a step, while a block's
    rounds were not yet recorded), shrinks when the race drops a plan or the confirmation needs fewer rounds than its
    most, and the bar ends full."""
    rank0_logging()
    job = _job(progress=True)
    seen: list = []
    warm_up_descriptions: set = set()
    monkeypatch.setattr(tune_module, "measured_round", _round_on_a_schedule(job, seen, warm_up_descriptions))
    schedule = job._measure(workload=None, group=None, rank0=True, board=None)
    capsys.readouterr()

    warm_up, scheduled = seen[:8], seen[8:]
    assert warm_up == [(n, 8) for n in range(1, 9)]  # the warm-up's own count, full at its last step
    assert warm_up_descriptions == {"warm-up"} and job._bar.desc == "measured"  # a full warm-up bar is not the end
    totals = [total for _, total in scheduled]
    assert all(n <= total for n, total in scheduled)
    assert all(later <= earlier for earlier, later in pairwise(totals))
    assert totals[-1] < totals[0]  # the drop and the confirmation's rounds came in under the worst case
    assert schedule.race.alive != [0, 1, 2, 3] and schedule.confirmation is not None
    assert job._bar.n == len(seen) and job._bar.total == job._bar.n
