"""runtime.recording.overlap_timer on a real one-rank FSDP2 model: times the largest all-gather, leaves the model
resharded."""

from __future__ import annotations

import torch

from runtime.recording.overlap_timer import overlap_timings
from runtime.reference_workloads import mlp
from runtime.workload import fsdp_modules


def test_overlap_timings_time_the_largest_module_and_reshard(mesh):
    workload = mlp(mesh, dim=64, layers=3)
    modules = fsdp_modules(workload.model)
    largest = modules[2][0]
    numels = {fqn: (500 if fqn == largest else 100) for fqn, _ in modules}
    # chosen by size, the same on every rank, not by this rank's timings (which name another module here)
    all_gather_ms = {fqn: (1.0 if fqn == largest else 5.0) for fqn, _ in modules}
    timings = overlap_timings(modules, numels, all_gather_ms, repeats=2)
    assert timings.module == largest
    assert all(getattr(timings, k) > 0 for k in ("all_gather_ms", "compute_ms", "overlapped_ms"))
    # "both" runs the compute too: it cannot take less than most of the compute alone
    assert timings.overlapped_ms > 0.5 * timings.compute_ms
    # every module is left resharded: the training step that follows works and starts from shards
    for _, m in modules:
        assert all(isinstance(p.data, torch.distributed.tensor.DTensor) for p in m.parameters())
    workload.loss_fn(workload.model, workload.make_batch(0)).backward()
