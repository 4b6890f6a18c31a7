"""runtime.recording.overlap_timer on a real one-rank FSDP2 model: times the largest all-gather, leaves the model
resharded."""

from __future__ import annotations

import torch

from runtime.recording.overlap_timer import overlap_timings
from runtime.reference_workloads import mlp
from runtime.workload import fsdp_modules


def test_overlap_timings_time_the_largest_module_and_reshard(mesh, monkeypatch):
    import runtime.recording.overlap_timer as overlap_timer

    calls = []
    matmuls = overlap_timer._matmuls
    monkeypatch.setattr(overlap_timer, "_matmuls", lambda count, a, b: (calls.append(count), matmuls(count, a, b)))
    workload = mlp(mesh, dim=64, layers=3)
    modules = fsdp_modules(workload.model)
    largest = modules[2][0]
    numels = {fqn: (500 if fqn == largest else 100) for fqn, _ in modules}
    # chosen by size, the same on every rank, not by this rank's timings (which name another module here)
    all_gather_ms = {fqn: (1.0 if fqn == largest else 5.0) for fqn, _ in modules}
    timings = overlap_timings(modules, numels, all_gather_ms, repeats=2)
    assert timings.module == largest
    assert all(getattr(timings, k) > 0 for k in ("all_gather_ms", "compute_ms", "overlapped_ms"))
    # "both" runs the compute too, the same matmuls as the compute alone, in every round (the first warms up), after
    # the 5 calibration runs of 4; not the time it happened to take, which a sub-millisecond compute cannot bound
    sized = calls[5:]
    assert calls[:5] == [4] * 5 and len(sized) == 2 * 3 and len(set(sized)) == 1
    # every module is left resharded: the training step that follows works and starts from shards
    for _, m in modules:
        assert all(isinstance(p.data, torch.distributed.tensor.DTensor) for p in m.parameters())
    workload.loss_fn(workload.model, workload.make_batch(0)).backward()
