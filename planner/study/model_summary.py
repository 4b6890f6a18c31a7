"""What ``tune`` logs about the model it searches with: the measured and simulated default step, the in-step
parameters, and on CPU how much of the measured step was the kernel's page-fault work."""

from __future__ import annotations

from planner.artifacts.profile import InStepTimings, Profile
from planner.simulation.simulator import SimParams, SimResult

FAULTS_PER_STEP_MS_NOTED = 30
"""On a CPU device under the system allocator, a default step with at least this many page faults per ms of its
step gets the line that names ``[launch] allocator = "jemalloc"`` ([Note: The allocator's share of the anchor] in
:mod:`planner.simulation.in_step`): from here the faults' work, each zeroing its page, is a few percent of the step
(docs/decisions/rule-evidence.md). The kernel's CPU ms alone are not the test: with no faults a step still spends
kernel time on gloo's socket copies and the scheduler."""


def model_summary(profile: Profile, default: SimResult, params: SimParams) -> list[str]:
    """The lines (indented, no level) ``tune`` logs before its simulated stage.

    Args:
        profile: the profile searched with.
        default: the simulator's run of FSDP2's default plan on it, ms and bytes.
        params: the simulator's parameters (the profile's calibration, else its in-step parameters).
    """
    lines = []
    if profile.measured_step_ms:
        exposed = profile.measured_step_ms - default.compute_ms
        lines.append(f"measured step {profile.measured_step_ms:.1f} ms with FSDP2's default, of which {exposed:.1f} "
                     f"ms ({100 * exposed / profile.measured_step_ms:.0f}%) is not compute (exposed communication and "
                     "overhead)")
    lines.append(f"simulated default: step {default.step_ms:.1f} ms, exposed communication "
                 f"{default.exposed_comm_ms:.1f} ms, lower bound {default.lower_bound_ms:.1f} ms")
    in_step = profile.in_step
    if in_step is not None and not profile.calibration:
        source = ("solved from the async default's step" if in_step.async_default_step_ms is not None
                  and profile.fingerprint.device_type != "cuda" else "measured")
        lines.append(f"in-step parameters: comm_scale {params.comm_scale:.2f} (solved from the measured default "
                     f"step), overlap_slowdown {params.overlap_slowdown:.2f} ({source})")
    if in_step is not None and profile.fingerprint.device_type == "cpu":
        lines.extend(step_usage_lines(in_step))
    return [f"      {line}" for line in lines]


def step_usage_lines(in_step: InStepTimings) -> list[str]:
    """The default step's page faults and kernel CPU ms, and the allocator it ran under; under the system allocator
    from :data:`FAULTS_PER_STEP_MS_NOTED` faults a ms on, a second line on what they do to the predictions and the
    setting that removes them. ``[]`` where the profile did not measure them (a trace, an older profile)."""
    share, faults = in_step.kernel_share(), in_step.default_step_faults
    if share is None or faults is None:  # share is None where the kernel ms are
        return []
    lines = [f"the default's step took {faults:,} page faults and {in_step.default_step_kernel_ms:.0f} ms of kernel "
             f"CPU ({100 * share:.0f}% of the step: the faults, gloo's socket copies, the scheduler), under the "
             f"{in_step.allocator or 'unknown'} allocator"]
    if in_step.allocator == "system" and faults >= FAULTS_PER_STEP_MS_NOTED * in_step.default_step_ms:
        lines.append("the simulator does not model the faults: their work is priced into comm_scale, and under "
                     "glibc it depends on what the process freed before, so the same step can take another time in "
                     "another process; [launch] allocator = \"jemalloc\" keeps the pages "
                     "(docs/decisions/cpu-allocator.md)")
    return lines


def allocator_mismatch(profile: Profile, allocator: str, path: str) -> str | None:
    """The warning ``tune --from-profile`` logs when the CPU profile at ``path`` was recorded with its ranks under
    another allocator than ``allocator`` (the study's ``[launch] allocator``): its default step, the simulator's
    anchor, then comes from another page-fault regime. ``None``: the same, not known (a trace), or a GPU profile."""
    recorded = profile.in_step.allocator if profile.in_step is not None else None
    if profile.fingerprint.device_type != "cpu" or recorded is None or recorded == allocator:
        return None
    return (f"profile {path!r} was recorded with the ranks under the {recorded} allocator and this study's run under "
            f"{allocator}: its default step, the simulator's anchor, may not be this run's (the race measures every "
            "plan here); re-record it under this study (prefetch-planner profile) to tune from this run's level")
