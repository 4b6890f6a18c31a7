"""runtime.recorder on a real one-rank FSDP2 model: what its isolated figures hold, and in which order it times them."""

from __future__ import annotations

import runtime.collective_timer as collective_timer
import runtime.recorder as recorder
from runtime.apply import model_fingerprint
from runtime.reference_workloads import mlp
from runtime.torch_private import reshard_after_forward
from runtime.workload import fsdp_modules, train_step


def test_the_collectives_are_timed_after_the_step_and_before_the_isolated_passes(mesh, monkeypatch):
    """[Note: The collectives are timed before the isolated passes]: every all-gather, the overlap microbenchmark and
    every reduce-scatter run before the compute passes, whose freed memory would spare them a step's page faults;
    the figures of both land on every module, and a pass without collectives times none."""
    workload = mlp(mesh, dim=64, layers=3)
    train_step(workload, 0)
    modules = fsdp_modules(workload.model)
    calls: list[str] = []

    def logged(name, real):
        def run(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return run

    for name in ("all_gather_ms", "overlap_timings", "reduce_scatter_ms"):
        monkeypatch.setattr(collective_timer, name, logged(name, getattr(collective_timer, name)))
    monkeypatch.setattr(recorder, "compute_unsharded", logged("compute_unsharded", recorder.compute_unsharded))
    raf = {fqn: reshard_after_forward(m) for fqn, m in modules}
    figures = recorder.isolated_figures(workload, model_fingerprint(workload.model), 1, "cpu", raf)
    assert calls == ["all_gather_ms", "overlap_timings", *["reduce_scatter_ms"] * len(modules), "compute_unsharded"]
    assert figures["overlap"] is not None
    for fqn, _ in modules:
        values = figures["modules"][fqn]
        assert values["all_gather_ms"] > 0 and values["reduce_scatter_ms"] > 0 and values["sharded_bytes"] > 0
        assert "fwd_ms" in values and "bwd_ms" in values

    calls.clear()
    only = recorder.isolated_figures(workload, model_fingerprint(workload.model), 1, "cpu", raf, collectives=False)
    assert calls == ["compute_unsharded"] and only["overlap"] is None
    assert all("all_gather_ms" not in values for values in only["modules"].values())
