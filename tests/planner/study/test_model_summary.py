"""What tune logs about the model: the kernel's share of the measured default step, and a profile recorded under
another allocator ([Note: The allocator's share of the anchor] in planner/simulation/in_step.py)."""

from __future__ import annotations

import dataclasses

import pytest

from planner.artifacts.plan import Plan
from planner.artifacts.profile import InStepTimings
from planner.simulation.parameters import simulator_for
from planner.study.model_summary import FAULTS_PER_STEP_MS_NOTED, allocator_mismatch, model_summary
from planner.testing import synthetic_profile


def _profile(device: str = "cpu", **in_step):
    profile = synthetic_profile(n_blocks=3, device=device)
    return dataclasses.replace(profile, measured_step_ms=200.0, in_step=InStepTimings(200.0, **in_step))


def _summary(profile) -> list[str]:
    simulator = simulator_for(profile)
    return model_summary(profile, simulator.run(Plan.default(profile)), simulator.params)


def test_a_faulting_step_under_glibc_is_named_with_its_share_and_the_setting_that_removes_it():
    lines = _summary(_profile(allocator="system", default_step_faults=450_000, default_step_kernel_ms=80.0))
    assert any("450,000 page faults and 80 ms of kernel CPU (40% of the step" in line and "under the system allocator"
               in line for line in lines), lines
    assert any('allocator = "jemalloc"' in line for line in lines), lines


@pytest.mark.parametrize(("allocator", "faults"), [
    ("jemalloc", 450_000),  # the setting already holds the pages: nothing to suggest
    ("system", int(200.0 * FAULTS_PER_STEP_MS_NOTED * 0.9)),  # fewer faults a ms than the line's threshold
    ("system", 0),  # kernel CPU without faults (gloo's socket copies) is not the allocator's
])
def test_the_setting_is_named_only_where_glibc_faults_are_many_for_the_step(allocator, faults):
    lines = _summary(_profile(allocator=allocator, default_step_faults=faults, default_step_kernel_ms=80.0))
    assert any(f"under the {allocator} allocator" in line for line in lines), lines
    assert not any('allocator = "jemalloc"' in line for line in lines), lines


@pytest.mark.parametrize("profile", [
    _profile(),  # not measured: a trace, an older profile
    _profile("cuda", allocator="system", default_step_faults=9, default_step_kernel_ms=150.0),  # a GPU step
], ids=["not measured", "cuda"])
def test_no_kernel_line_where_it_was_not_measured_or_the_step_runs_on_a_gpu(profile):
    lines = _summary(profile)
    assert lines and not any("kernel CPU" in line for line in lines), lines


def test_a_cpu_profile_from_another_allocator_is_warned_about_once_and_nothing_else_is():
    jemalloc = _profile(allocator="jemalloc", default_step_kernel_ms=1.0)
    warning = allocator_mismatch(jemalloc, "system", "p.json")
    assert warning is not None and "'p.json'" in warning and "jemalloc allocator" in warning
    assert "under system" in warning and "\n" not in warning
    assert allocator_mismatch(jemalloc, "jemalloc", "p.json") is None
    assert allocator_mismatch(_profile(), "system", "p.json") is None  # not known: a trace
    assert allocator_mismatch(_profile("cuda", allocator="jemalloc"), "system", "p.json") is None
