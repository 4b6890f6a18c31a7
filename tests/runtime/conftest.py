"""The runtime tests' fixtures: a one-rank gloo process group in this process (multi-rank: tests/multirank.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def mesh():
    """A one-rank gloo process group in this process, and its CPU mesh (for FSDP2 models in unit tests)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tests.ports import free_port

    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()
