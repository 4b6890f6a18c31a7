"""The reference workloads' batches: the same tokens per (step, rank), on the mesh's device."""

from __future__ import annotations

import torch

from runtime.reference_workloads import _batch_fn


def test_batches_follow_the_mesh_device_and_stay_deterministic():
    on_meta = _batch_fn(100, 2, 8, rank=1, device="meta")(3)
    assert on_meta.device.type == "meta" and on_meta.shape == (2, 8)  # e.g. "cuda" under NCCL
    first, again = _batch_fn(100, 2, 8, rank=1)(3), _batch_fn(100, 2, 8, rank=1)(3)
    assert first.device.type == "cpu" and torch.equal(first, again)
    assert not torch.equal(first, _batch_fn(100, 2, 8, rank=0)(3))  # each rank its own data
