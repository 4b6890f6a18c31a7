"""The calibrate job: one rank of one fresh launch of a cluster's calibration ([Note: What a calibration runs]).

``prefetch-planner calibrate`` (and ``tune``, where the cluster has no
calibration) starts it once per launch. Every rank builds two model
instances; rank 0 picks the launch's pair (FSDP2's default against a second
copy of itself, or against a plan of the search space no race picked,
``planner.study.cluster_spread.calibration_pairs``) and the rounds' order.
Each plan runs on its own model instance from its first step, warmed up,
then the rounds (each pair of rounds in both orders, which first at
random); rank 0 stores the launch with the cluster's other calibration
launches.
"""

from __future__ import annotations

from jobs.confirm import rounds_on_own_models
from planner.artifacts.config import StudyConfig
from planner.artifacts.plan import Plan
from planner.artifacts.profile import Profile
from planner.statistics.launches import ConfirmLaunch
from planner.statistics.schedule import confirmation_orders
from planner.storages import open_storage, storage_errors
from planner.storages.archive import stored_profiles
from planner.study.candidates import plan_key
from planner.study.cluster_spread import (
    DEFAULT_PAIR,
    ClusterKey,
    ClusterSpread,
    calibration_pairs,
    calibration_plan,
    cluster_spread,
    record_calibration_launch,
    unselected_plans,
)
from planner.study.in_loop import same_job
from runtime.apply import model_fingerprint
from runtime.current import fsdp2_default
from runtime.ranks.collectives import from_rank0
from runtime.ranks.rank import job_rank
from runtime.workload import build_study_workload
from search_spaces import get_space

# Plans of the search space no race picked, beside FSDP2's default against a copy of itself.
UNSELECTED = 2


class CalibrateJob:
    """One rank of calibration launch ``launch`` of ``launches`` for the study's cluster.

    Args:
        config: the study (its model, ranks, search space and storage).
        launch: this launch's index, from 0.
        launches: the calibration's launches (the pairs are spread over them).
        profile_in: a profile of the model to draw the unselected plans on; ``None``: the study's latest stored
            profile of this model and world, else FSDP2's default against a copy of itself only.
    """

    def __init__(self, config: StudyConfig, launch: int, launches: int, profile_in: str | None = None):
        self.config, self.launch, self.launches, self.profile_in = config, launch, launches, profile_in

    def run(self) -> ClusterSpread | None:
        """Run this rank's part; rank 0 returns the cluster's spread after this launch, the other ranks ``None``.

        Raises:
            PlannerError: a plan that does not fit the model, or a storage error (every rank raises rank 0's).
            StepFailed: a step raised on this rank.
        """
        launch = self.config.launch
        with job_rank(launch) as rank:
            mesh, group, rank0 = rank.mesh, rank.group, rank.rank0
            try:
                models = [build_study_workload(self.config.workload, mesh) for _ in range(2)]
                fingerprint = model_fingerprint(models[0].model)
                default = fsdp2_default(models[0].model)  # every module's: a factory's own prefetch undone
                pair, other, orders = from_rank0(lambda: self._pair(fingerprint, default), group)
                times = rounds_on_own_models(models, [other, default], orders, max(2, self.config.measure.warmup_steps),
                                             group)
                models = None
                rank.ended = True
                if rank0:
                    return self._record(fingerprint, pair, ConfirmLaunch(times[0], times[1]))
                return None
            finally:
                models = None

    def _pair(self, fingerprint, default: Plan) -> tuple[str, Plan, list[list[int]]]:
        """Rank 0: this launch's pair, its plan (``default``'s copy, or an unselected plan), and the rounds'
        order."""
        profile = self._profile(fingerprint)
        unselected = []
        if profile is not None:
            unselected = unselected_plans(profile, get_space(self.config.search.space), UNSELECTED,
                                          self.config.search.seed)
        pairs = calibration_pairs(self.launches, [plan_key(p) for p in unselected])
        pair = pairs[self.launch % len(pairs)]
        plan = calibration_plan(pair, default, unselected)
        return pair, plan, confirmation_orders((0, 1), self.config.measure.calibration_rounds)

    def _profile(self, fingerprint) -> Profile | None:
        if self.profile_in is not None:
            return Profile.load(self.profile_in)
        with storage_errors(self.config.storage_url):
            storage = open_storage(self.config.storage_url, self.config)
            try:
                profiles = [p for p in stored_profiles(storage.engine, self.config.name)
                            if same_job(p.fingerprint, fingerprint)]
            finally:
                storage.engine.dispose()
        return profiles[-1] if profiles else None

    def _record(self, fingerprint, pair: str, launch: ConfirmLaunch) -> ClusterSpread:
        key = ClusterKey.of(fingerprint, self.config.launch.backend)
        with storage_errors(self.config.storage_url):
            storage = open_storage(self.config.storage_url, self.config)
            try:
                record_calibration_launch(storage.engine, key, pair, self.config.name, launch)
                return cluster_spread(storage.engine, key)
            finally:
                storage.engine.dispose()


def describe_pair(pair: str) -> str:
    """``FSDP2's default against a second copy of itself`` or ``... against unselected plan 3f2a...``."""
    return ("FSDP2's default against a second copy of itself" if pair == DEFAULT_PAIR
            else f"FSDP2's default against unselected plan {pair}")
