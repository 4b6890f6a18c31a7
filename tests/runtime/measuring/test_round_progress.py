"""runtime.measuring.protocol.measured_round's progress on a real one-rank FSDP2 model: the warm-up's step count it
announces is the number of steps it then runs before the schedule's first block (``jobs.tune`` draws the bar's
total from it)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from planner.artifacts.plan import ModulePlan, Plan
from planner.statistics.schedule import Phase
from runtime.apply import model_fingerprint
from runtime.measuring.protocol import measured_round
from runtime.measuring.round import warm_up_steps
from runtime.ranks.torch_private import reshard_after_forward
from runtime.recording.peak_memory import PEAK_STEPS
from runtime.reference_workloads import mlp
from runtime.workload import fsdp_modules


@dataclass(frozen=True)
class _Trial:
    number: int
    plan: Plan


class _OneBlock:
    """A schedule of one round of every plan; notes the steps run when its first block was asked for."""

    phase = Phase.RACE

    def __init__(self, plans: int, steps_so_far):
        self.plans, self.steps_so_far, self.asked_at = plans, steps_so_far, None

    def next_block(self):
        if self.asked_at is not None:
            return None
        self.asked_at = self.steps_so_far()
        return [list(range(self.plans))]

    def record(self, block):
        pass


class _Stage:
    """Rank 0's side of the round: hands out the plans, keeps every one, records nothing."""

    def __init__(self, plans: list[Plan], steps_so_far):
        self.trials = [_Trial(n, p) for n, p in enumerate(plans)]
        self.steps_so_far, self.schedule = steps_so_far, None

    def prepare(self):
        return self.trials

    def over_budget(self, kept, peak_bytes):
        return {}

    def start(self, kept, peak_bytes):
        self.schedule = _OneBlock(len(kept), self.steps_so_far)
        return self.schedule

    def tell(self, asked, step_ms, per_rank):
        return []

    def fail(self, asked, reason, kind):
        raise AssertionError(f"no trial should fail here: {reason}")


@pytest.mark.parametrize("warmup_steps", [1, PEAK_STEPS, PEAK_STEPS + 2])
def test_the_warm_up_count_it_announces_is_the_steps_before_the_first_block(mesh, warmup_steps):
    import torch.distributed as dist

    workload = mlp(mesh, dim=32, layers=2)
    modules = fsdp_modules(workload.model)
    fingerprint = model_fingerprint(workload.model)
    default = Plan(fingerprint, {fqn: ModulePlan(reshard_after_forward=reshard_after_forward(m)) for fqn, m in modules})
    no_reshard = Plan(fingerprint, {fqn: ModulePlan(reshard_after_forward=False) for fqn, _ in modules})
    steps: list[int] = []
    announced: list[int] = []
    stage = _Stage([default, no_reshard], lambda: len(steps))

    result = measured_round(workload, stage, warmup_steps, dist.group.WORLD,
                            on_step=lambda: steps.append(1), on_warm_up=announced.append)

    assert result.failed == {}
    per_plan = len(warm_up_steps([0], warmup_steps))
    assert announced == [2 * per_plan] == [stage.schedule.asked_at]
    assert per_plan == max(warmup_steps, PEAK_STEPS)
    assert len(steps) == announced[0] + 2  # the block: one step of each plan
