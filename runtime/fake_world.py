"""A traced job's model, built in one process on a fake world: its fingerprint, for a profile made from traces."""

from __future__ import annotations

from torch.distributed.device_mesh import init_device_mesh

from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.json_types import JsonObject
from runtime.apply import model_fingerprint
from runtime.ranks.torch_private import fake_process_group
from runtime.workload import build_workload


def workload_fingerprint(factory: str, kwargs: JsonObject, world_size: int) -> Fingerprint:
    """The fingerprint of ``factory(mesh, **kwargs)``'s model, sharded over ``world_size`` ranks.

    The model is built on the CPU in this process, on a fake process group (no collective runs; nothing is
    trained), so the parameter counts and FQNs are the model's own, as ``apply`` checks them.

    Raises:
        WorkloadError: the factory cannot be imported, raises, or returns a model not wrapped with ``fully_shard``.
    """
    with fake_process_group(world_size):
        mesh = init_device_mesh("cpu", (world_size,))
        workload = build_workload(factory, mesh, kwargs)
        return model_fingerprint(workload.model, world_size)
