"""The isolated passes: each module's compute with every module (or a few) held unsharded and no communication, and
its collectives in isolation, outside a training step, on every rank (``runtime.recording.recorder.Recorder`` runs
them between steps, for ``tune`` and the in-loop tuner alike)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Collection

from torch import nn

from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.rank_measurements import (
    COMPUTE_FIELDS,
    ComputeMeasurements,
    IsolatedMeasurements,
    ModuleMeasurements,
)
from runtime.ranks.torch_private import clear_unsharded_grads
from runtime.recording.collective_timer import module_collectives
from runtime.recording.compute_timer import ComputeTimer, storage_of
from runtime.workload import Workload, fsdp_modules, own_parameters


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
                    own = [storage_of(p).data_ptr() for p in own_parameters(modules, fqn)]
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


