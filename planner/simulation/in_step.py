"""The simulator's global parameters, solved from the profile's in-step timings before any calibration.

[Note: Why the isolated figures are not enough]
The profile's module figures are timed in isolation, and a real step is
slower than they add up to, for three reasons:
- the first steps after a model is built run far slower than later ones,
  so the recorder times FSDP2's default step last, when the run is warm;
- collectives in a step do not take what the same collectives take alone
  after a barrier (FSDP2's copy-in and copy-out, rank skew; the recorder
  times them after a step, with the allocator as a step leaves it: [Note:
  The collectives are timed before the isolated passes] in runtime/recording/isolated.py).
  The default plan on CPU overlaps nothing, so its step time is
  ``compute + comm_scale * comm``, and ``comm_scale`` is solved from it;
- with ``unshard_async_op=True``, gloo's threads and the compute share the
  cores and slow each other, as an all-gather and matrix multiplies run
  alone and at once show (``runtime.recording.overlap_timer``).

[Note: The overlap slowdown is used as measured]
Where the profile holds no async step (below), the simulator takes the
slowdown the overlap microbenchmark measures (:data:`STEP_OVERLAP_SHARE` 1),
not a share of it fitted to past runs. With
half the measured excess, the model under-predicted the gain of keeping
blocks unsharded after forward (which saves their backward all-gathers): the
backward all-gathers of a prefetch-1 async plan are hidden far less than the
half assumed. Calibration starts from these values
(:mod:`planner.simulation.calibrate`).

[Note: The overlap slowdown from an async step]
The pair alone is not the step: inside a step the compute beside an
all-gather slows less than the microbenchmark's pair, which runs the two
flat out, so with the pair's slowdown every async plan is predicted too
slow against the default. Where the profile
holds the step of FSDP2's default with ``unshard_async_op``
(``InStepTimings.async_default_step_ms``, timed in turn with the default's
steps), the slowdown is solved from it instead, after ``comm_scale`` (on CPU
the default overlaps nothing, so ``comm_scale`` does not depend on it)
(docs/decisions/overlap-slowdown.md).

[Note: The allocator's share of the anchor]
On a CPU device the default's measured step holds the kernel's work for the
page faults of its fresh tensors. Under glibc that work is a large share of
the step, and it moves between processes, and within one, while the tensors
stay the same (docs/decisions/cpu-allocator.md). The simulator has no allocator: that work lands in ``comm_scale``,
the one
parameter solved from the step, and every plan is priced as if it faulted
as the default did in the recording process. Nothing here corrects for it,
since a plan's faults are not known before it runs. The recorder keeps the
step's faults and kernel ms (``InStepTimings.default_step_faults``,
``default_step_kernel_ms``) and ``tune`` logs the share
(:mod:`planner.study.model_summary`). Under ``[launch] allocator =
"jemalloc"`` a warm step takes no faults. What is left on a CPU is the
machine's own level, which moves from one half-minute to the next, so an
absolute CPU step prediction is not held to a few percent
(docs/decisions/cpu-step-level.md); paired ratios are.
"""

from __future__ import annotations

import dataclasses

from planner.artifacts.plan import Plan
from planner.artifacts.profile import OverlapTimings, Profile
from planner.simulation.simulator import SimParams, Simulator

# The range comm_scale is solved in, as planner.simulation.calibrate bounds it.
COMM_SCALE_BOUNDS = (0.25, 3.0)
# overlap_slowdown's range: 1 is no slowdown; 2 is fair sharing of one core.
OVERLAP_SLOWDOWN_BOUNDS = (1.0, 2.0)
# The share of the measured overlap excess a step sees ([Note: The overlap slowdown is used as measured]).
STEP_OVERLAP_SHARE = 1.0
# Below this sensitivity of the default step to comm_scale (fraction of the step over the whole range),
# the default hides its communication (GPU streams) and says nothing about comm_scale: keep 1.
MIN_SENSITIVITY = 0.02


def measured_slowdown(overlap: OverlapTimings) -> float:
    """The slowdown ``s`` of the overlap microbenchmark: compute ``C`` ms, all-gather ``M`` ms, both at once ``T`` ms.

    Both progress at ``1 / s`` while both run, so ``T = max(C, M) + min(C, M) * (s - 1)``,
    ``s = 1 + (T - max(C, M)) / min(C, M)``, clipped to :data:`OVERLAP_SLOWDOWN_BOUNDS`.
    """
    c, m, t = overlap.compute_ms, overlap.all_gather_ms, overlap.overlapped_ms
    low, high = OVERLAP_SLOWDOWN_BOUNDS
    if min(c, m) <= 0:
        return low
    return min(high, max(low, 1.0 + (t - max(c, m)) / min(c, m)))


def overlap_slowdown(overlap: OverlapTimings) -> float:
    """The simulator's ``overlap_slowdown``, ``1 + share * (s - 1)`` (share: :data:`STEP_OVERLAP_SHARE`)."""
    return 1.0 + STEP_OVERLAP_SHARE * (measured_slowdown(overlap) - 1.0)


def solve_comm_scale(profile: Profile, params: SimParams, measured_ms: float) -> float:
    """The ``comm_scale`` at which FSDP2's default plan's predicted step equals ``measured_ms``.

    Bisection: the predicted step does not decrease with ``comm_scale``.
    Clipped to :data:`COMM_SCALE_BOUNDS`; 1 when the default's step barely
    depends on it (:data:`MIN_SENSITIVITY`).
    """
    simulator = Simulator(profile, params)
    default = simulator.compile(Plan.default(profile))
    low, high = COMM_SCALE_BOUNDS

    def step(c: float) -> float:
        return simulator.run(default, dataclasses.replace(params, comm_scale=c)).step_ms

    if step(high) - step(low) < MIN_SENSITIVITY * measured_ms:
        return 1.0
    for _ in range(40):
        mid = 0.5 * (low + high)
        if step(mid) < measured_ms:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


def solve_overlap_slowdown(profile: Profile, params: SimParams, measured_ms: float, plan: Plan | None = None) -> float:
    """The ``overlap_slowdown`` at which ``plan`` (by default FSDP2's default plan with ``unshard_async_op``)
    predicts ``measured_ms`` ([Note: The overlap slowdown from an async step]).

    Bisection in :data:`OVERLAP_SLOWDOWN_BOUNDS`: the predicted step does not
    decrease with the slowdown. A step below the bound's prediction gives 1,
    one above gives 2.
    """
    simulator = Simulator(profile, params)
    plan = simulator.compile(plan or Plan.default(profile).with_knobs(unshard_async_op=True))
    low, high = OVERLAP_SLOWDOWN_BOUNDS
    for _ in range(40):
        mid = 0.5 * (low + high)
        if simulator.run(plan, dataclasses.replace(params, overlap_slowdown=mid)).step_ms < measured_ms:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


def in_step_params(profile: Profile) -> SimParams:
    """The simulator's parameters from ``profile.in_step``; the defaults without it.

    ``overlap_slowdown`` from the overlap timings (CPU); then ``comm_scale``
    solved so that FSDP2's default plan predicts the warm default step
    ([Note: Why the isolated figures are not enough]); then, where the
    profile holds the async default's step (CPU), ``overlap_slowdown`` solved
    from it ([Note: The overlap slowdown from an async step]). The other
    parameters keep their defaults. The profile's own calibration, if any, is
    ignored. About two hundred simulated steps: resolve it once per profile and
    pass it on.
    """
    params = SimParams()
    timings = profile.in_step
    if timings is None:
        return params
    cpu = profile.fingerprint.device_type != "cuda"
    if timings.overlap is not None and cpu:
        params = dataclasses.replace(params, overlap_slowdown=overlap_slowdown(timings.overlap))
    params = dataclasses.replace(params, comm_scale=solve_comm_scale(profile, params, timings.default_step_ms))
    if timings.async_default_step_ms is not None and cpu:
        params = dataclasses.replace(params, overlap_slowdown=solve_overlap_slowdown(
            profile, params, timings.async_default_step_ms))
    return params
