"""The recorder: measure a Profile from real training steps on every rank.

What it records and how (docs/architecture.md, "Measurement"):

- Gradient accumulation: the workload's microbatches per step (``Profile.microbatches``); the module figures below are
  per microbatch, the step figures per step (every microbatch and the optimizer).
- Peak memory, step ms and optimizer ms of FSDP2's default plan, after everything else, each step through the one
  step runner (:mod:`runtime.recording.steps`, its figures read by :mod:`runtime.recording.step_figures`): the peak
  of :data:`runtime.recording.peak_memory.PEAK_STEPS` untimed steps, and what the optimizer step allocates on top
  (:class:`runtime.recording.peak_memory.PeakMeter`); then the median over timed steps, last of all, when the run has
  settled (the first steps after the model is built run far slower: [Note: Why the isolated figures are not
  enough] in :mod:`planner.simulation.in_step`; the steps just after the isolated passes and the profiled peak
  steps too: [Note: The default's step is timed last]).
- Pre- and post-forward order of the FSDP modules, with multiplicity, from forward hooks; compute ms per module,
  forward and backward, exclusive of nested FSDP modules (:class:`runtime.recording.compute_timer.ComputeTimer`):
  every FSDP module is unsharded first, with ``reshard_after_forward`` off, gradient sync off
  (``set_requires_gradient_sync(False)``) and ``set_reshard_after_backward(False)``, so no collective runs inside the
  window; each module's unsharded gradients are freed when its backward ends, as in a step ([Note: The isolated
  backward frees each module's gradients]).
- Activation bytes saved for backward, per module; and whether autograd saves any of its parameters (if not, e.g. an
  embedding, its parameters need no all-gather in backward: ``set_unshard_in_backward(False)``).
- Backward temporaries per module: the most bytes alive in its backward above its start, less its gradient and
  recomputed activations, read in the isolated passes' first, untimed repeat ([Note: Backward temporaries] in
  :mod:`runtime.recording.compute_timer`).
- All-gather ms and reduce-scatter ms in isolation, all ranks together (:mod:`runtime.recording.collective_timer`),
  medians of rounds over every module ([Note: Collectives timed in rounds]).
- On a CPU device, the all-gather of the module with the most unsharded parameters and compute, alone and at once
  (:mod:`runtime.recording.overlap_timer`). These and the collectives are timed first, after the warm-up steps, before
  the isolated compute passes ([Note: The collectives are timed before the isolated passes]).
- Per-rank figures are gathered (:func:`runtime.ranks.collectives.gather_objects`) and consolidated: max across ranks
  (the
  overlap timings: mean across ranks), per-rank kept.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Collection

import torch.distributed as dist
from torch import nn

from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.profile import Profile
from planner.artifacts.rank_measurements import (
    COMPUTE_FIELDS,
    ComputeMeasurements,
    IsolatedMeasurements,
    ModuleMeasurements,
    RankMeasurements,
    StepMeasurements,
)
from runtime.apply import model_fingerprint
from runtime.current import fsdp2_default
from runtime.ranks.allocator import loaded_allocator
from runtime.ranks.collectives import gather_objects
from runtime.ranks.torch_private import clear_unsharded_grads, reshard_after_forward, unshard_async_op_setter
from runtime.recording.collective_timer import module_collectives
from runtime.recording.compute_timer import ComputeTimer
from runtime.recording.consolidation import consolidate, merge_isolated
from runtime.recording.peak_memory import PEAK_STEPS
from runtime.recording.process_usage import process_usage
from runtime.recording.step_figures import StepFigures
from runtime.recording.steps import WorkloadSteps
from runtime.timing import RECORD, RECORD_PEAK, TIMED, RoundStep, device_type_of
from runtime.workload import Workload, fsdp_modules, own_parameters, parameter_rows, train_step

# [Note: The async default, timed in turn with the default]
# On a CPU device the simulator's overlap slowdown is solved from FSDP2's default plan with unshard_async_op
# ([Note: The overlap slowdown from an async step] in planner/simulation/in_step.py). Its step is timed in pairs with
# the default's, the order rotated from pair to pair, and kept as the median ratio of the two (a CPU step drifts by
# as much as the gain, docs/decisions/cpu-step-level.md: a ratio of neighbours cancels the drift). At least
# ASYNC_PAIRS pairs.
ASYNC_PAIRS = 5

# [Note: The default's step is timed last]
# The default's step ms is the anchor of every step prediction (comm_scale is solved from it: [Note: Why the
# isolated figures are not enough] in planner/simulation/in_step.py), so it is timed where the process's steps have
# settled: after the profiled peak steps and the async pairs, not right after the isolated passes or the profiler.
# On CPU the steps just after the passes can run slower than default steps a minute later (the passes' freed
# memory and the profiler leave the heap and caches in another state), and so can the first step after the
# profiled peak steps. So the peak steps run first and the pairs after them: the pairs need no settled stretch,
# their ratio of neighbours cancels the drift. Re-timing the anchor where its steps disagree with the pairs' was
# tried and rejected (docs/decisions/anchor-guard.md).


def _default_plan_steps(workload: Workload, steps: int) -> StepMeasurements:
    """FSDP2's default plan through the step runner (:class:`runtime.recording.steps.WorkloadSteps`, its figures
    read by :class:`runtime.recording.step_figures.StepFigures`), in this order: its peak memory; on CPU at world
    size 2 or more, the async default's step over the default's ([Note: The async default, timed in turn with the
    default]); then its median step ms and optimizer ms over ``steps`` timed steps ([Note: The default's step is
    timed last]), with their mean page faults and kernel CPU ms a step and the allocator the rank runs under
    ([Note: The allocator's share of the anchor] in planner/simulation/in_step.py).

    Raises:
        StepFailed: a step raised.
    """
    figures = StepFigures(workload.model, [workload.optimizer])
    runner = WorkloadSteps(workload, [fsdp2_default(workload.model)], applied=0)  # as wrapped: nothing applied
    runner.side.recorder = figures
    try:
        runner.run_all([RoundStep(RECORD_PEAK, 0)] * PEAK_STEPS)
        async_ratio = None
        if runner.side.device == "cpu" and dist.get_world_size() > 1:
            set_async_op = unshard_async_op_setter(workload.model)
            ratios = []
            for s in range(max(steps, ASYNC_PAIRS)):
                timed = {}
                for async_op in (False, True) if s % 2 == 0 else (True, False):
                    set_async_op(async_op)
                    [timed[async_op]] = runner.run_all([RoundStep(TIMED, 0)])
                ratios.append(timed[True] / timed[False])
            set_async_op(False)
            async_ratio = statistics.median(ratios)
        before = process_usage()
        runner.run_all([RoundStep(RECORD, 0)] * steps)
        usage = process_usage() - before  # the barriers' waits are user-space spins or sleeps, not faults
    finally:
        figures.remove()
    return figures.measurements(async_ratio=async_ratio, step_faults=usage.faults // steps,
                                step_kernel_ms=usage.system_ms / steps, allocator=str(loaded_allocator()))


def _hold_unsharded(model: nn.Module, modules: list[tuple[str, nn.Module]], held: set[str], every: bool) -> None:
    """Unshard the ``held`` modules and keep them so, with gradient sync off (:func:`compute_unsharded`): every
    module at once, or each held one with an explicit prefetch of itself in place of its implicit backward
    prefetch."""
    model.set_requires_gradient_sync(False)
    if every:
        model.set_reshard_after_forward(False)
        model.set_reshard_after_backward(False)
    for fqn, m in modules:
        if fqn not in held:
            continue
        if not every:
            m.set_reshard_after_forward(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
            m.set_modules_to_backward_prefetch([m])
        m.unshard()


def _release(model: nn.Module, modules: list[tuple[str, nn.Module]], held: set[str], resharding: dict[str, bool],
             every: bool) -> None:
    """Undo :func:`_hold_unsharded`: gradient sync on, each module's ``reshard_after_forward`` as ``resharding`` says,
    FSDP2's implicit backward prefetch back, unsharded gradients freed, every module resharded."""
    model.set_requires_gradient_sync(True)
    model.set_reshard_after_backward(True)
    for fqn, m in modules:
        m.set_reshard_after_forward(resharding[fqn], recurse=False)
        if not every and fqn in held:
            m.set_modules_to_backward_prefetch([])
        clear_unsharded_grads(m)
        m.reshard()


def compute_unsharded(workload: Workload, repeats: int, device: str, resharding: dict[str, bool],
                      zero_grad: bool = True, only: Collection[str] | None = None) -> IsolatedMeasurements:
    """Compute ms per module and phase, orders and activation bytes, with every module unsharded, no communication
    (the figures without collectives or overlap).

    Gradient sync is off in the window (nothing is reduced into the sharded gradients); each module's unsharded
    gradients are freed when its backward ends, as FSDP2's reduce-scatter frees them in a step ([Note: The
    isolated backward frees each module's gradients]), again after the window, and every module is resharded
    with ``resharding``'s ``reshard_after_forward``. ``zero_grad``: also
    ``optimizer.zero_grad(set_to_none=True)`` (the in-loop tuner leaves the user's gradients alone).

    ``only``: hold only these modules unsharded (``planner.study.in_loop.isolation_groups``, under a memory
    budget); the others run as in FSDP2's default (all-gather in pre-forward and pre-backward, reshard after),
    and the timer's hooks run before FSDP2's, so their all-gathers stay in their own windows. A held module's
    implicit backward prefetch (of the next module in backward, in its own window) is turned off by an explicit
    prefetch of itself, a no-op (``FSDPParamGroup.unshard`` returns at once on an unsharded group); FSDP2's
    default (implicit) is restored after. Only the held modules' figures are clean: the caller keeps theirs
    (``times``, ``activation_bytes``, ``needs_parameters_in_backward``, ``recompute_bytes``, ``backward_peak``
    hold only theirs). The warm-up repeat, dropped from the times, reads the memory alive at each mark:
    ``backward_peak``, and ``root_grad_pre_bytes`` (``None``: the root not held) ([Note: Backward temporaries] in
    :mod:`runtime.recording.compute_timer`); every run reads ``root_activation_post_bytes`` (``None``: the root not
    held;
    [Note: The root's saved tensors in two parts] there).
    """
    model = workload.model
    modules = fsdp_modules(model)
    held = {fqn for fqn, _ in modules} if only is None else set(only)
    _hold_unsharded(model, modules, held, every=only is None)
    by_fqn = dict(modules)

    def free_gradients(fqn: str) -> None:  # [Note: The isolated backward frees each module's gradients]
        clear_unsharded_grads(by_fqn[fqn])

    timer = ComputeTimer(modules, modules[0][0], device, hooks_first=only is not None, after_backward=free_gradients)
    samples: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    needs: dict[str, bool] = {}
    try:
        for r in range(repeats + 1):  # the first repeat warms up and is dropped
            timer.run(workload, r, memory=r == 0)
            times, pre_order, post_order, calls = timer.attribute()
            if r == 0:  # a held module registers its unsharded parameters
                for fqn in held:
                    own = [p.untyped_storage().data_ptr() for p in own_parameters(modules, fqn)]
                    needs[fqn] = not own or any(ptr in timer.saved_parameter_storages for ptr in own)
                    # a checkpointed block saves no parameter, yet its recompute reads them all
                    needs[fqn] = needs[fqn] or fqn in timer.recomputing
                continue
            for fqn, _ in modules:
                for key in COMPUTE_FIELDS:
                    samples[fqn][key].append(times.get(fqn, {}).get(key, 0.0))
    finally:
        timer.remove()
        _release(model, modules, held, resharding, every=only is None)
        if zero_grad:
            workload.optimizer.zero_grad(set_to_none=True)
    root = modules[0][0]
    figures = {fqn: ModuleMeasurements(ComputeMeasurements(
        **{k: statistics.median(samples[fqn][k]) for k in COMPUTE_FIELDS},
        activation_bytes=timer.act_bytes.get(fqn, 0), recompute_activation_bytes=timer.recompute_bytes.get(fqn, 0),
        backward_peak_bytes=timer.backward_peak.get(fqn, 0), needs_parameters_in_backward=needs[fqn],
        grad_pre_bytes=timer.root_grad_pre_bytes if fqn == root else None,
        activation_post_bytes=timer.root_activation_post_bytes if fqn == root else None))
        for fqn, _ in modules if fqn in held}
    return IsolatedMeasurements(None, tuple(pre_order), tuple(post_order), calls, figures)


# [Note: The collectives are timed before the isolated passes]
# On CPU each collective allocates its output afresh, and memory the allocator gave back to the kernel is faulted in
# again. The isolated passes hold every module unsharded and free it all at the end, so collectives timed just after
# them reuse faulted-in memory that a step's collectives do not find, and read low against a step's
# (docs/decisions/collectives-in-rounds.md). So they are timed first, after a step (the warm-up steps,
# or the user's step in the loop). On GPU the caching allocator keeps its blocks either way.


# [Note: The isolated backward frees each module's gradients]
# With gradient sync off, FSDP2 leaves each module's gradients on its unsharded parameters until they are cleared.
# Kept until the end of the isolated pass, every module's backward wrote its gradients into memory no earlier
# module had freed; in a step, FSDP2's post-backward reduce-scatters them and frees them (``foreach_reduce``), and
# the next module's gradients reuse that memory. So the timer frees them when each module's backward ends (its
# ``after_backward``, after its window is marked), as the step does; kept to the end of the pass, every backward
# pays for fresh memory and reads above a traced step's.


def record_profile(workload: Workload, warmup_steps: int = 2, steps: int = 3, repeats: int = 3,
                   per_module: bool = False) -> Profile:
    """Record a :class:`Profile` on every rank (collective: all ranks call it).

    Args:
        workload: this rank's workload; its model must not have run a plan
            other than FSDP2's default.
        warmup_steps: untimed default-plan steps first.
        steps: timed default-plan steps (step ms, optimizer ms), run last; before them the peak steps, then, on
            CPU at world size 2 or more, as many pairs (at least ``ASYNC_PAIRS``) of the default and the async
            default in turn.
        repeats: repeats of each compute and communication measurement
            (medians are kept; one extra warm-up repeat is dropped).
        per_module: the isolated compute passes hold one module unsharded at a time, the others as in FSDP2's
            default (what the in-loop tuner does under a tight memory budget); else every module at once.

    Returns:
        The consolidated profile (the same on every rank). Times in ms,
        sizes in bytes.
    """
    model = workload.model
    modules = fsdp_modules(model)
    device = device_type_of(workload)
    fingerprint = model_fingerprint(model, dist.get_world_size())
    for s in range(warmup_steps):  # the optimizer state exists before its bytes are counted
        train_step(workload, s)
    resharding = {fqn: reshard_after_forward(m) for fqn, m in modules}
    if per_module:
        isolated = merge_isolated([isolated_measurements(workload, fingerprint, repeats, device, resharding,
                                                         only=(fqn,), collectives=i == 0)
                                   for i, (fqn, _) in enumerate(modules)])
    else:
        isolated = isolated_measurements(workload, fingerprint, repeats, device, resharding)
    local = RankMeasurements(dist.get_rank(), _default_plan_steps(workload, steps), isolated)
    return consolidate(gather_objects(local), fingerprint, resharding, isolated.calls, workload.microbatches,
                       parameter_rows(modules))


def isolated_measurements(workload: Workload, fingerprint: Fingerprint, repeats: int, device: str,
                          resharding: dict[str, bool], zero_grad: bool = True, only: Collection[str] | None = None,
                          collectives: bool = True) -> IsolatedMeasurements:
    """This rank's figures measured outside a training step (collective: all ranks call it, after a step).

    Per FSDP module: all-gather and reduce-scatter ms in isolation (:mod:`runtime.recording.collective_timer`), sharded
    bytes and, on a CPU device, the overlap microbenchmark (:mod:`runtime.recording.overlap_timer`), timed first ([Note:
    The collectives are timed before the isolated passes]); then forward and backward compute with every module
    unsharded and no communication (:func:`compute_unsharded`), activation bytes, whether backward needs its
    parameters. Times in ms, sizes in bytes.

    Args:
        workload: its ``make_batch(r)`` and ``loss_fn`` drive the compute windows (``repeats + 1`` passes).
        resharding: each module's ``reshard_after_forward`` to restore after the window.
        zero_grad: passed to :func:`compute_unsharded`.
        only: the compute figures of these modules alone, held unsharded while the others run as in FSDP2's
            default (:func:`compute_unsharded`); ``None``: every module, held at once.
        collectives: also the all-gather, reduce-scatter and overlap figures of every module (one module
            unsharded at a time).

    Returns:
        The figures :func:`consolidate` reads; passes of a few modules each make one with :func:`merge_isolated`.
    """
    modules = fsdp_modules(workload.model)
    collective_measurements, overlap = {}, None
    # first, where the last step left the allocator: [Note: The collectives are timed before the isolated passes]
    if collectives:
        collective_measurements, overlap = module_collectives(modules, fingerprint, repeats, device)
    compute = compute_unsharded(workload, repeats, device, resharding, zero_grad=zero_grad, only=only)
    collectives_only = {fqn: ModuleMeasurements(collectives=c) for fqn, c in collective_measurements.items()}
    measured = IsolatedMeasurements(overlap, compute.pre_forward_order, compute.post_forward_order, compute.calls,
                                    collectives_only)
    return measured.merged(compute)


