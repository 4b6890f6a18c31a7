"""A traced job's model, built in one process on a fake world: its fingerprint, for a profile made from traces."""

from __future__ import annotations

from collections.abc import Sequence

from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.json_types import JsonObject
from runtime.apply import model_fingerprint
from runtime.ranks.rank import job_mesh
from runtime.ranks.torch_private import fake_process_group
from runtime.workload import build_workload


def workload_fingerprint(factory: str, kwargs: JsonObject, world_size: int, mesh: Sequence[int] | None = None,
                         tensor_parallel: int = 1) -> Fingerprint:
    """The fingerprint of ``factory(mesh, **kwargs)``'s model on ``world_size`` ranks, on the mesh a job's ranks
    start (``runtime.ranks.rank.job_mesh``: ``[launch] mesh`` and ``tensor_parallel``).

    The model is built on the CPU in this process, on a fake process group (no collective runs; nothing is
    trained), so the parameter counts and FQNs are the model's own, as ``apply`` checks them (under FSDP + TP the
    TP-local counts, which only the 2-D mesh gives).

    Raises:
        WorkloadError: the factory cannot be imported, raises, or returns a model not wrapped with ``fully_shard``.
    """
    with fake_process_group(world_size):
        workload = build_workload(factory, job_mesh("cpu", world_size, mesh, tensor_parallel), kwargs)
        return model_fingerprint(workload.model, world_size)
