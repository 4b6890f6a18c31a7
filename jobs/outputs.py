"""What a command checks before it starts any rank: the study's factory, this machine's ranks, the storage and the
folders of the files it writes. Nothing is written."""

from __future__ import annotations

from pathlib import Path

from planner.artifacts.config import StudyConfig
from planner.errors import PlannerError


def check_output_folders(*outputs: str | None) -> None:
    """Each output file's folder must exist (nothing is created; ``None`` entries are skipped).

    Raises:
        PlannerError: naming the first output whose folder is missing.
    """
    for out in filter(None, outputs):
        if not Path(out).parent.is_dir():
            raise PlannerError(f"cannot write {out!r}: folder {str(Path(out).parent)!r} does not exist")


def check_before_launch(config: StudyConfig, *outputs: str | None, storage: bool = True,
                        profile_in: str | None = None) -> None:
    """What the launching process of ``tune``, ``profile``, ``confirm``, ``calibrate`` and ``verify`` checks before
    it starts any rank, in this order: the factory imports, this machine runs the study's ``[launch]`` ranks
    (``runtime.ranks.rank.check_runnable``), the storage is writable (``storage``), each output's folder exists,
    and ``profile_in`` reads as a profile.

    Raises:
        WorkloadError: the factory cannot be imported.
        StudyConfigError: this machine cannot run the study's ranks.
        StorageError: the storage is unreachable, its driver missing, or locked.
        PlannerError: an output's folder does not exist.
        ProfileFormatError: ``profile_in`` cannot be read as a profile.
    """
    from planner.artifacts.profile import Profile
    from planner.storages import check_writable
    from runtime.ranks.rank import check_runnable
    from runtime.workload import load_factory

    load_factory(config.workload.factory)
    check_runnable(config.launch.backend, config.launch.nproc_per_node, config.launch.allocator, config.launch.mesh,
                   config.launch.tensor_parallel)
    if storage:
        check_writable(config.storage_url)
    check_output_folders(*outputs)
    if profile_in is not None:
        Profile.load(profile_in)
