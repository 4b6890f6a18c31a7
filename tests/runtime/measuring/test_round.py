"""runtime.measuring.round.MeasuredRound on a real one-rank FSDP2 model: what each driver hands it and what it
records (a plan that does not apply, a peak over the budget, a step that raised, a step that raised because of a
peer), without the study: a stage that notes every call. And the tune job's driver
(``runtime.measuring.measure.measured_round``): the warm-up's step count it announces is the number of steps it runs
before the schedule's first block (``jobs.tune`` draws the progress bar's total from it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch.distributed as dist

from planner.artifacts.plan import ModulePlan, Plan
from planner.errors import FailKind, TrialFailedError
from planner.failed_steps import StepFailure
from planner.statistics.schedule import Phase
from runtime.apply import model_fingerprint
from runtime.measuring.measure import measured_round
from runtime.measuring.round import MeasuredRound, warm_up_steps
from runtime.ranks.torch_private import reshard_after_forward
from runtime.recording.peak_memory import PEAK_STEPS
from runtime.recording.steps import WorkloadSteps
from runtime.reference_workloads import mlp
from runtime.timing import PEAK, TIMED, WARMUP, RoundStep, step_failure
from runtime.workload import fsdp_modules


@dataclass(frozen=True)
class _Trial:
    number: int
    plan: Plan


class _Rounds:
    """``rounds`` rounds of every plan kept, one block each; records them, and notes ``steps_so_far()`` when its
    first block was asked for."""

    phase = Phase.RACE

    def __init__(self, plans: int, rounds: int, steps_so_far=lambda: 0):
        self.plans, self.left, self.recorded = plans, rounds, []
        self.steps_so_far, self.asked_at = steps_so_far, None

    def next_block(self):
        if self.asked_at is None:
            self.asked_at = self.steps_so_far()
        if self.left == 0:
            return None
        self.left -= 1
        return [list(range(self.plans))]

    def record(self, block):
        self.recorded.append(block)


class _Stage:
    """Rank 0's side: hands out the plans, leaves out the positions in ``over``, notes each FAIL."""

    def __init__(self, plans: list[Plan], over: dict[int, str] | None = None, rounds: int = 2, steps_so_far=lambda: 0):
        self.trials = [_Trial(10 + n, p) for n, p in enumerate(plans)]
        self.over, self.rounds, self.steps_so_far = over or {}, rounds, steps_so_far
        self.failed: list[tuple[list[int], str, FailKind]] = []
        self.peaks: list[int] = []
        self.schedule = None

    def prepare(self):
        return self.trials

    def over_budget(self, kept, peak_bytes):
        self.peaks = peak_bytes
        return self.over

    def start(self, kept, peak_bytes):
        self.schedule = _Rounds(len(kept), self.rounds, self.steps_so_far)
        return self.schedule

    def tell(self, asked, step_ms, per_rank):
        return [a.plan for a in asked]

    def fail(self, asked, reason, kind):
        self.failed.append(([a.number for a in asked], reason, kind))


@pytest.fixture(scope="module")
def workload(mesh):
    return mlp(mesh, dim=32, layers=2)


def _plans(workload) -> list[Plan]:
    modules = fsdp_modules(workload.model)
    fingerprint = model_fingerprint(workload.model)
    default = Plan(fingerprint, {fqn: ModulePlan(reshard_after_forward=reshard_after_forward(m)) for fqn, m in modules})
    no_reshard = Plan(fingerprint, {fqn: ModulePlan(reshard_after_forward=False) for fqn, _ in modules})
    return [default, no_reshard]


def _foreign(plan: Plan) -> Plan:
    """``plan`` for a model with other parameter counts: the fingerprint check refuses it."""
    fp = plan.fingerprint
    return Plan(dataclasses.replace(fp, param_numels=tuple(n + 1 for n in fp.param_numels)), plan.modules)


def test_a_round_runs_warm_ups_then_blocks_and_tells_each_kept_plan_its_times(workload):
    plans = _plans(workload)
    stage = _Stage(plans, rounds=2)
    round_ = MeasuredRound(dist.group.WORLD, stage, warmup_steps=PEAK_STEPS + 1)
    assert round_.ask() == plans
    runner = WorkloadSteps(workload, plans, dist.group.WORLD)
    todo = round_.apply_everywhere(workload.model)
    assert todo == [RoundStep(WARMUP, 0)] + [RoundStep(PEAK, 0)] * PEAK_STEPS + [RoundStep(WARMUP, 1)] + [
        RoundStep(PEAK, 1)] * PEAK_STEPS
    _, failure = runner.run(todo, round_.peaks)
    assert failure is None and all(len(p) == PEAK_STEPS and min(p) > 0 for p in round_.peaks)
    todo = round_.start()
    assert len(stage.peaks) == 2 and todo == [RoundStep(TIMED, 0), RoundStep(TIMED, 1)]
    blocks = 0
    while todo is not None:
        todo = round_.record(*runner.run(todo, round_.peaks))
        blocks += 1
    assert blocks == 2 and len(stage.schedule.recorded) == 2
    assert [len(t) for t in round_.step_ms] == [2, 2] and round_.per_rank[1][0] == round_.step_ms[1]
    assert round_.tell() == plans and stage.failed == [] and round_.failed_trials() == {}


def test_a_plan_that_does_not_apply_is_fail_error_and_the_rest_goes_on(workload):
    plans = _plans(workload)
    stage = _Stage([plans[0], _foreign(plans[1]), plans[1]])
    round_ = MeasuredRound(dist.group.WORLD, stage, warmup_steps=1)
    round_.ask()
    todo = round_.apply_everywhere(workload.model)
    assert round_.kept == [0, 2] and {s.plan for s in todo} == {0, 2}
    [(numbers, reason, kind)] = stage.failed
    assert numbers == [11] and kind == FailKind.ERROR and reason.startswith("applying the plan failed on rank 0:")
    assert round_.failed_trials() == {11: reason}


def test_without_the_baseline_there_is_no_round(workload):
    plans = _plans(workload)
    stage = _Stage([_foreign(plans[0]), plans[1]])
    round_ = MeasuredRound(dist.group.WORLD, stage, warmup_steps=1)
    round_.ask()
    assert round_.apply_everywhere(workload.model) is None
    assert [(n, k) for n, _, k in stage.failed] == [([10], FailKind.ERROR), ([10, 11], FailKind.INTERRUPTED)]


def test_a_plan_over_the_budget_is_left_out_with_the_stages_reason(workload):
    plans = _plans(workload)
    stage = _Stage(plans, over={1: "measured peak 9 MiB over the memory budget 8 MiB"}, rounds=1)
    round_ = MeasuredRound(dist.group.WORLD, stage, warmup_steps=1)
    round_.ask()
    WorkloadSteps(workload, plans).run(round_.apply_everywhere(workload.model), round_.peaks)
    assert round_.start() == [RoundStep(TIMED, 0)]
    assert round_.kept == [0] and round_.failed_trials() == {11: "measured peak 9 MiB over the memory budget 8 MiB"}


@pytest.mark.parametrize("victim", [False, True])
def test_a_step_that_raised_fails_its_trial_and_interrupts_the_rest(workload, victim):
    plans = _plans(workload)
    stage = _Stage(plans)
    round_ = MeasuredRound(dist.group.WORLD, stage, warmup_steps=1)
    round_.ask()
    WorkloadSteps(workload, plans).run(round_.apply_everywhere(workload.model), round_.peaks)
    round_.start()
    error = TimeoutError("Timed out waiting for rank 1") if victim else RuntimeError("boom")
    failure = step_failure(1, error)
    assert failure.victim is victim

    with pytest.raises(TrialFailedError, match="trial 11 failed on rank 0: .*this job stops"):
        round_.record([12.0], failure)
    assert [(n, k) for n, _, k in stage.failed] == [([11], FailKind.ERROR), ([10], FailKind.INTERRUPTED)]
    assert stage.failed[1][1].startswith("not measured: trial 11 failed in the same round (rank 0: ")


def test_the_step_runner_reports_the_step_that_raised_and_runs_none_after_it(workload):
    plans = _plans(workload)
    seen = []
    broken = workload.model.forward

    def fail_under_plan_1(*args, **kwargs):
        if len(seen) == 1:
            raise RuntimeError("the step raised")
        return broken(*args, **kwargs)

    workload.model.forward = fail_under_plan_1
    try:
        times, failure = WorkloadSteps(workload, plans, dist.group.WORLD).run(
            [RoundStep(TIMED, 0), RoundStep(TIMED, 1), RoundStep(TIMED, 0)], on_step=lambda: seen.append(1))
    finally:
        del workload.model.forward
    # no time is read after a failure (a step's end event behind a peer's collective might never complete)
    assert times == [] and len(seen) == 1 and failure == StepFailure(1, "RuntimeError: the step raised", False)


@pytest.mark.parametrize("warmup_steps", [1, PEAK_STEPS, PEAK_STEPS + 2])
def test_the_warm_up_count_it_announces_is_the_steps_before_the_first_block(workload, warmup_steps):
    steps: list[int] = []
    announced: list[int] = []
    stage = _Stage(_plans(workload), rounds=1, steps_so_far=lambda: len(steps))

    result = measured_round(workload, stage, warmup_steps, dist.group.WORLD,
                            on_step=lambda: steps.append(1), on_warm_up=announced.append)

    assert result.failed == {} and stage.failed == []
    per_plan = len(warm_up_steps([0], warmup_steps))
    assert announced == [2 * per_plan] == [stage.schedule.asked_at]
    assert per_plan == max(warmup_steps, PEAK_STEPS)
    assert len(steps) == announced[0] + 2  # the block: one step of each plan


@pytest.fixture
def board(mesh):
    from runtime.ranks.failures import FailureBoard

    board = FailureBoard.open(dist.group.WORLD, stuck_after_s=5)
    yield board
    board.close()


@pytest.mark.parametrize("where", ["warm-up", "block"])
def test_a_step_that_raised_on_every_rank_in_step_leaves_its_plan_out_and_the_round_goes_on(workload, board, where):
    """Every rank's step raised at the same point (here the one rank's): the board's agreement goes on. The plan's
    trial is FAIL (error) with the rank's cause, the plan leaves the round, and a fresh schedule runs over the plans
    kept (the baseline and the third plan); no other trial is failed."""
    default, no_reshard = _plans(workload)
    plans = [default, no_reshard, no_reshard]
    stage = _Stage(plans, rounds=1)
    round_ = MeasuredRound(dist.group.WORLD, stage, warmup_steps=1, board=board)
    round_.ask()
    runner = WorkloadSteps(workload, plans, dist.group.WORLD, board=board)
    runner.run(round_.apply_everywhere(workload.model), round_.peaks)
    failure = step_failure(1, RuntimeError("out of coffee"))
    if where == "warm-up":
        round_.peaks[2] = []  # plan 2's warm-up had not run when plan 1's raised
        todo = round_.start(failure)
        assert {s.plan for s in todo} == {2} and round_.kept == [0, 2]
        todo = round_.record(*runner.run(todo, round_.peaks))
    else:
        todo = round_.record(*runner.run(round_.start(), round_.peaks)[:1], failure)
    assert todo == [RoundStep(TIMED, 0), RoundStep(TIMED, 2)] and round_.kept == [0, 2]
    assert stage.failed == [([11], "rank 0: RuntimeError: out of coffee", FailKind.ERROR)]
    while todo is not None:
        todo = round_.record(*runner.run(todo, round_.peaks))
    assert round_.tell() == [default, no_reshard]
    assert round_.failed_trials() == {11: "rank 0: RuntimeError: out of coffee"}
    assert not board.posted()  # the agreement closed the failure's epoch


def test_a_failure_posted_by_a_peer_stops_the_steps_before_the_next_one(workload, board):
    """A post on the board (a peer's step raised): the runner runs no further step and reports no failure of its own;
    the round's next gather then goes to the agreement (tests/runtime/ranks/test_cluster.py drives it on two ranks)."""
    plans = _plans(workload)
    stage = _Stage(plans)
    round_ = MeasuredRound(dist.group.WORLD, stage, warmup_steps=1, board=board)
    round_.ask()
    runner = WorkloadSteps(workload, plans, dist.group.WORLD, board=board)
    runner.run(round_.apply_everywhere(workload.model), round_.peaks)
    todo = round_.start()
    board.store.set(board._key(0, "failure", 0), '{"plan": 1, "error": "OutOfMemoryError: x", "victim": false, '
                                                   '"out_of_memory": true}')
    board.store.set(board._key(0, "posted"), "1")
    steps_before = board.steps
    times, failure = runner.run(todo, round_.peaks)
    assert times == [] and failure is None and board.steps == steps_before and board.posted()
