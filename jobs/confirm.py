"""The confirm job: one rank of one fresh confirmation launch ([Note: Confirming across launches]).

``prefetch-planner tune`` starts it ``[measure] confirm_launches`` times after
its tuning ranks exit. Every rank builds the model afresh; rank 0 reads the
job's race survivor and its job's baseline from the study
(``planner.study.confirmation.pending``). With ``[measure]
confirm_model_per_plan`` (the default) each plan gets its own model
instance, applied before its first step and never switched, as a user's
job runs it; else one model switches plans step by step, as in the race.
Every rank warms each plan up and runs the rounds the survivor's trial asks
for, in the order rank 0 drew (each pair of rounds in both orders, which
first at random); rank 0 appends the rounds to the trial. Nothing
here profiles the model or pre-unshards it.
"""

from __future__ import annotations

import torch.distributed as dist

from planner.artifacts.config import StudyConfig
from planner.artifacts.plan import Plan
from planner.statistics.launches import ConfirmLaunch
from planner.statistics.schedule import confirmation_orders
from planner.study.confirmation import pending, record_launch
from runtime.apply import configure_plan
from runtime.measuring.measure import measure_plans
from runtime.ranks.collectives import from_rank0, gather_max
from runtime.ranks.rank import job_rank
from runtime.recording.steps import WorkloadSteps
from runtime.timing import TIMED, WARMUP, RoundStep, StepCounter, StepFailed
from runtime.workload import Workload, build_study_workload


class ConfirmJob:
    """One rank of a confirmation launch for tuning job ``job`` of the study.

    Args:
        config: the study.
        job: the tuning job whose race survivor is confirmed.
        rounds: rounds of this launch (the confirmation's design, sized by the launching process); ``None``: the
            rounds the survivor's trial asks for.
    """

    def __init__(self, config: StudyConfig, job: str, rounds: int | None = None):
        self.config = config
        self.job = job
        self.rounds = rounds

    def run(self) -> int | None:
        """Run this rank's part; rank 0 returns the launches the survivor now has (``0``: nothing awaited
        confirmation), the other ranks ``None``.

        Raises:
            PlannerError: no such job, a plan that does not fit the model, or a storage error (every rank raises
                rank 0's).
            StepFailed: a step raised on this rank.
        """
        launch = self.config.launch
        with job_rank(launch) as rank:
            mesh, group, rank0 = rank.mesh, rank.group, rank.rank0
            try:
                workload = build_study_workload(self.config.workload, mesh)

                def launch_rounds() -> tuple | None:
                    p = pending(self.config, self.job)
                    # the order of each pair of rounds is drawn here, once, and every rank runs it
                    rounds = self.rounds or (p.rounds if p is not None else 0)
                    return None if p is None else (p.survivor, p.baseline, confirmation_orders((0, 1), rounds))

                payload = from_rank0(launch_rounds, group)
                if payload is None:
                    rank.ended = True
                    return 0 if rank0 else None
                survivor, baseline, orders = payload
                plans = [survivor, baseline]
                for plan in plans:
                    configure_plan(workload.model, plan, check=True)
                warmup = max(2, self.config.measure.warmup_steps)
                if self.config.measure.confirm_model_per_plan:
                    models = [workload, build_study_workload(self.config.workload, mesh)]
                    times = rounds_on_own_models(models, plans, orders, warmup, group)
                    models = None
                else:
                    times = measure_plans(WorkloadSteps(workload, plans, group), orders, warmup)
                rank.ended = True
                if rank0:
                    return record_launch(self.config, survivor.provenance.trial, ConfirmLaunch(times[0], times[1]))
                return None
            finally:
                workload = None


def rounds_on_own_models(models: list[Workload], plans: list[Plan], orders: list[list[int]], warmup: int,
                         group: dist.ProcessGroup) -> list[list[float]]:
    """Plan ``i`` applied once to ``models[i]``; ``warmup`` untimed steps each, then the rounds ``orders``, every
    step through the one step runner (``runtime.recording.steps.WorkloadSteps``, one per model, one step counter).

    Returns:
        On rank 0, per plan, its steps' max across ranks, ms (the other ranks get them too).

    Raises:
        StepFailed: a step raised on this rank.
    """
    for model, plan in zip(models, plans, strict=True):
        configure_plan(model.model, plan, check=True)
    counter = StepCounter()
    runners = [WorkloadSteps(model, [plan], group, counter, applied=0)
               for model, plan in zip(models, plans, strict=True)]

    def step(i: int, kind: str) -> None:
        try:
            runners[i].step(RoundStep(kind, 0))
        except Exception as e:
            runners[i].side.abandon()
            raise StepFailed(i, e) from e

    for _ in range(warmup):
        for i in range(len(models)):
            step(i, WARMUP)
    for order in orders:
        for i in order:
            step(i, TIMED)
    local = [runner.side.take_times() for runner in runners]
    maxed, _ = gather_max(local[0] + local[1], group)
    return [maxed[:len(orders)], maxed[len(orders):]]
