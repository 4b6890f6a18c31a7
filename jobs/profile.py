"""The profile job: one rank of ``prefetch-planner profile``, the recorder that ``tune`` uses, on the study's ranks.

A model that arrives with a plan of its own (the factory set prefetch lists, resharding or knobs) is recorded under
FSDP2's default, as a profile claims, and its own plan is read back and handed out (``prefetch-planner check``).
"""

from __future__ import annotations

import torch

from jobs.process_state import load_tune_modules
from planner.artifacts.config import StudyConfig
from planner.artifacts.plan import Plan
from planner.artifacts.profile import Profile
from planner.simulation.parameters import simulate
from runtime.current import current_plan, record_under_fsdp2_default
from runtime.ranks.rank import job_rank
from runtime.recording.recorder import record_profile
from runtime.workload import Workload, build_study_workload, train_step


class ProfileJob:
    """Record a profile on every rank; rank 0 writes it (and, with ``torch_trace``, one step's torch.profiler trace).

    Args:
        config: the study (workload, launch, measure tables).
        output: where rank 0 writes the profile JSON.
        torch_trace: where rank 0 writes one more default-plan step's
            ``torch.profiler`` Chrome trace, to compare with ``prefetch-planner
            simulate --trace`` track by track; ``None``: no trace.
        own_plan_out: where rank 0 writes the plan the model arrived with (``runtime.current_plan``), always
            (FSDP2's default when it had no other); ``None``: not written.
    """

    def __init__(self, config: StudyConfig, output: str, torch_trace: str | None = None,
                 own_plan_out: str | None = None):
        self.config = config
        self.output = output
        self.torch_trace = torch_trace
        self.own_plan_out = own_plan_out

    def run(self) -> tuple[Profile, float, Plan | None] | None:
        """Run this rank's part (every rank calls it).

        Returns:
            Rank 0: the profile written, FSDP2's default plan's predicted
            step ms on it, and the plan the model arrived with when it was not
            FSDP2's default (``None`` when it was); other ranks ``None``.

        Raises:
            PlannerError: a bad workload (the same on every rank).
        """
        load_tune_modules()  # [Note: Record in tune's process state]

        with job_rank(self.config.launch) as rank:
            mesh = rank.mesh
            workload: Workload | None = None
            try:
                workload = build_study_workload(self.config.workload, mesh)
                own = record_under_fsdp2_default(workload.model)
                measure = self.config.measure
                profile = record_profile(workload, warmup_steps=max(1, measure.warmup_steps), steps=measure.steps,
                                         repeats=measure.profile_repeats, budget=self.config.search.budget(),
                                         collectives=measure.collectives)
                if self.torch_trace:
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                        train_step(workload, 0)
                    if rank.rank0:
                        prof.export_chrome_trace(self.torch_trace)
                rank.ended = True
                if not rank.rank0:
                    return None
                profile.to_json(self.output)
                if self.own_plan_out:
                    (own or current_plan(workload.model)).to_json(self.own_plan_out)
                return profile, simulate(profile, Plan.default(profile)).step_ms, own
            finally:
                workload = None
