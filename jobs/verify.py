"""The verify job: a plan re-measured against FSDP2's default in processes started as a user's job starts
(``prefetch-planner verify PLAN.json STUDY.toml``).

[Note: Verify as a user's job]
A confirmation is a promise about the user's job: load the plan's JSON at training start and the step is that much
faster. ``verify`` keeps that promise's conditions and nothing else: every rank builds the study's model twice
from its factory, applies the plan read from its file to one (``load_plan``, ``apply_plan``: what a training script
calls) and leaves the other as ``fully_shard`` wrapped it (FSDP2's default, no setter called), warms both up, then
times interleaved rounds of one step each (each pair of rounds in both orders, which first at random), the ranks
aligned once before them and each step on the device's clock, its figure the max across ranks. Nothing of the tuner
runs or is imported in a rank: no study, no simulator, no Optuna, no recorder, no profile (:data:`TUNER_MODULES`
are checked absent, and the launch says so).
Each launch is a fresh ``torch.distributed.run`` of the study's ``[launch]`` ranks; the launches' rounds are combined
as a confirmation's are (``planner.statistics.verdict.confirm_launches``) and set against the plan's recorded claim
([Note: A claim checked against its re-measurement] in :mod:`planner.statistics.agreement`).
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from planner.artifacts.config import StudyConfig
from planner.artifacts.plan import Plan
from planner.errors import PlanMismatchError

logger = logging.getLogger(__name__)

TUNER_MODULES = ("optuna", "sqlalchemy", "search_spaces", "planner.study", "planner.simulation",
                 "planner.storages", "runtime.recording", "runtime.measuring", "runtime.in_loop", "jobs.tune")
"""What a tuning job loads and a user's job does not: none of it may be imported in a verify rank."""

WARMUP_STEPS = 2  # per model, in turn, before the timed rounds


@dataclass(frozen=True)
class LaunchTimes:
    """One verify launch: per round, each model's step ms (max across ranks), and what its ranks had loaded.

    Attributes:
        plan_ms, default_ms: the rounds' step times, ms.
        tuner_modules: :data:`TUNER_MODULES` found loaded on any rank (``[]``: none).
        world_size: the ranks.
    """

    plan_ms: list[float]
    default_ms: list[float]
    tuner_modules: list[str]
    world_size: int

    def to_json(self, path: str | Path) -> None:
        """Write the launch's figures (the launching process reads them, :meth:`load`)."""
        Path(path).write_text(json.dumps(self.__dict__))

    @classmethod
    def load(cls, path: str | Path) -> LaunchTimes:
        """Read what :meth:`to_json` wrote."""
        return cls(**json.loads(Path(path).read_text()))


def check_before_launch(config: StudyConfig, plan_path: str) -> Plan:
    """What the launching process checks before it starts any rank; writes nothing. Returns the plan.

    The plan's fingerprint is checked against the study's model built in this process on a fake process group of
    the study's world size (``runtime.fake_world``): a plan for another model is refused here, before any rank starts;
    a plan made at another world size is verified, with the one-line warning that its gain was confirmed there
    ([Note: Plans travel] in ``planner.artifacts.plan``): verifying it here is how it is re-confirmed.

    Raises:
        PlanFormatError: the plan file is missing or malformed.
        WorkloadError: the factory cannot be imported or built.
        StudyConfigError: this machine cannot run the study's ranks.
        PlanMismatchError: the plan was made for another model.
    """
    from jobs.outputs import check_before_launch as check_launch
    from runtime.apply import load_plan
    from runtime.fake_world import workload_fingerprint

    plan = load_plan(plan_path)
    check_launch(config, storage=False)
    model = workload_fingerprint(config.workload.factory, config.workload.kwargs, config.launch.nproc_per_node,
                                 config.launch.mesh, config.launch.tensor_parallel)
    difference = plan.fingerprint.model_difference(model)
    if difference is not None:
        raise PlanMismatchError(f"plan {plan_path!r} is not for this study's model: {difference}; verify it with the "
                                "study it was tuned on")
    note = plan.fingerprint.travel_note(model)
    if note is not None:
        logger.warning(note)
    return plan


def verify_rank(config: StudyConfig, plan_path: str, rounds: int) -> LaunchTimes | None:
    """One rank of one verify launch ([Note: Verify as a user's job]); every rank calls it, rank 0 returns the
    launch's times, the others ``None``.

    Raises:
        PlanFormatError, PlanMismatchError: the plan cannot be read, or is for another model.
        WorkloadError: the factory fails.
    """
    import torch.distributed as dist

    from planner.statistics.schedule import confirmation_orders
    from runtime.apply import configure_plan, load_plan
    from runtime.ranks.collectives import from_rank0, gather_max, gather_objects
    from runtime.ranks.device import device_of
    from runtime.ranks.rank import job_rank
    from runtime.timing import StepCounter, device_type_of
    from runtime.workload import build_study_workload, train_step

    with job_rank(config.launch) as rank:
        models = []
        try:
            plan = load_plan(plan_path)
            models = [build_study_workload(config.workload, rank.mesh) for _ in range(2)]
            configure_plan(models[0].model, plan)  # the other stays as fully_shard wrapped it: FSDP2's default
            device = device_of(device_type_of(models[0]))
            steps = StepCounter()
            for _ in range(WARMUP_STEPS):
                for workload in models:
                    train_step(workload, steps.next())
            orders = from_rank0(lambda: confirmation_orders((0, 1), rounds), rank.group)
            # As a raced block is timed ([Note: What a step costs the device] in runtime.recording.steps, which this
            # user-like process does not load): the ranks aligned once, each step between two marks on the device's
            # clock, the marks read once at the end.
            timed: list[tuple[int, tuple[object, object]]] = []
            device.align(rank.group)
            for order in orders:
                for index in order:
                    start = device.mark()
                    train_step(models[index], steps.next())
                    timed.append((index, (start, device.mark())))
            local: list[list[float]] = [[], []]
            for (index, _), ms in zip(timed, device.spans_ms([span for _, span in timed]), strict=True):
                local[index].append(ms)
            maxed, _ = gather_max(local[0] + local[1], rank.group)
            loaded = gather_objects([m for m in TUNER_MODULES if m in sys.modules], rank.group)
            rank.ended = True
            if not rank.rank0:
                return None
            return LaunchTimes(maxed[:rounds], maxed[rounds:], sorted({m for r in loaded for m in r}),
                               dist.get_world_size())
        finally:
            models = []
