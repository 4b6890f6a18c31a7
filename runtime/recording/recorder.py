"""The one recorder: a Profile from real training steps on every rank, for ``tune`` and ``profile`` (a workload
factory's steps, :func:`record_profile`) and for the in-loop tuner (the user's own steps inside ``tuner.step()``)
alike: :class:`Recorder`. The two differ only in their schedule and in the loss the isolated backward runs (the
workload's where there is one; in a user's loop, which hands the tuner no loss, the sum of the model's outputs on
the first step's inputs, ``surrogate_loss``).

What it records and how (docs/architecture.md, "Measurement"):

- Gradient accumulation: the workload's microbatches per step (``Profile.microbatches``); the module figures below are
  per microbatch, the step figures per step (every microbatch and the optimizer).
- Peak memory, step ms and optimizer ms of FSDP2's default plan, each step through the one step runner
  (:mod:`runtime.recording.steps`, its figures read by :mod:`runtime.recording.step_figures`): first the peak of
  :data:`runtime.recording.peak_memory.PEAK_STEPS` untimed steps, and what the optimizer step allocates on top
  (:class:`runtime.recording.peak_memory.PeakMeter`), which the isolated passes' memory rule reads ([Note:
  Profiling within the device's memory] in :mod:`planner.study.isolation`); then the median over timed steps,
  last of all, when the run has
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

import logging
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from planner.artifacts.config import StudyConfig
from planner.artifacts.memory_budget import MemoryBudget
from planner.artifacts.profile import Profile
from planner.artifacts.rank_measurements import IsolatedMeasurements, RankMeasurements
from planner.errors import PlannerError
from planner.study.isolation import isolation_groups, isolation_limit
from planner.traces.in_step_collectives import in_step_collectives
from runtime.apply import model_fingerprint
from runtime.current import fsdp2_default
from runtime.ranks.allocator import loaded_allocator
from runtime.ranks.budget import tightest_capacity
from runtime.ranks.collectives import gather_objects
from runtime.ranks.device import device_of
from runtime.ranks.torch_private import reshard_after_forward, unshard_async_op_setter
from runtime.recording.collective_trace import AUTO, TRACED_STEPS, traces_collectives
from runtime.recording.compute_timer import tensors_in
from runtime.recording.consolidation import consolidate, merge_isolated, with_in_step_collectives
from runtime.recording.isolated import isolated_measurements
from runtime.recording.peak_memory import PEAK_STEPS
from runtime.recording.process_usage import process_usage
from runtime.recording.step_figures import StepFigures
from runtime.recording.steps import WorkloadSteps
from runtime.timing import RECORD, RECORD_PEAK, RECORD_TRACE, RECORD_WARMUP, TIMED, RoundStep
from runtime.workload import Workload, fsdp_modules, parameter_rows, train_step

logger = logging.getLogger(__name__)

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


def _peak_steps(workload: Workload, figures: StepFigures) -> WorkloadSteps:
    """FSDP2's default's peak steps through the step runner, their figures read by ``figures``: the runner, for
    the default's later steps (:func:`_default_plan_steps`).

    Raises:
        StepFailed: a step raised.
    """
    runner = WorkloadSteps(workload, [fsdp2_default(workload.model)], applied=0)  # as wrapped: nothing applied
    runner.side.recorder = figures
    runner.run_all([RoundStep(RECORD_PEAK, 0)] * PEAK_STEPS)
    return runner


def _default_plan_steps(runner: WorkloadSteps, steps: int, traced: bool = False) -> dict[str, Any]:
    """FSDP2's default's timed steps through the step runner (:class:`runtime.recording.steps.WorkloadSteps`, its
    figures read by its recorder), after its peak steps and the isolated passes: on CPU at world size 2 or more,
    the async default's step over the default's ([Note: The async default, timed in turn with the default]); then
    ``steps`` timed steps ([Note: The default's step is timed last]); then, ``traced``, the collectives' traced steps
    (``runtime.recording.collective_trace``), untimed.

    Returns:
        The step figures the recorder does not read: the async ratio, the timed steps' mean page faults and kernel
        CPU ms a step, and the allocator the rank runs under ([Note: The allocator's share of the anchor] in
        planner/simulation/in_step.py), as :class:`~planner.artifacts.rank_measurements.StepMeasurements` fields.

    Raises:
        StepFailed: a step raised.
    """
    async_ratio = None
    if runner.side.device == "cpu" and dist.get_world_size() > 1:
        set_async_op = unshard_async_op_setter(runner.workload.model)
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
    if traced:
        runner.run_all([RoundStep(RECORD_TRACE, 0)] * TRACED_STEPS)
    return {"async_ratio": async_ratio, "step_faults": usage.faults // steps,
            "step_kernel_ms": usage.system_ms / steps, "allocator": str(loaded_allocator())}


def _detached(obj: Any) -> Any:
    """``obj`` with every tensor detached and cloned (lists, tuples and dicts rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return type(obj)((k, _detached(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detached(v) for v in obj)
    return obj


def surrogate_loss(output: Any) -> torch.Tensor:
    """The sum of every floating-point output tensor that requires grad, in float32: a backward pass as long as the
    user's (the same graph), for the isolated compute windows of a user's loop, which hands the tuner no loss.

    Raises:
        PlannerError: the forward returned no tensor that requires grad.
    """
    tensors = [t for t in tensors_in(output) if t.is_floating_point() and t.requires_grad]
    if not tensors:
        raise PlannerError("the model's forward returned no floating-point tensor that requires grad; the in-loop "
                           "recorder cannot run a backward pass on it")
    return sum(t.float().sum() for t in tensors)


class Recorder(StepFigures):
    """The step figures of FSDP2's default (:class:`~runtime.recording.step_figures.StepFigures`) and the isolated
    passes between steps, into a :class:`Profile`.

    Args:
        model: the root FSDP module.
        repeats: repeats of each isolated measurement (medians; one warm-up repeat dropped).
        workload: the workload whose batches and loss the isolated passes run (``tune``, ``profile``); ``None``:
            a user's loop, whose first step's inputs are kept and run with :func:`surrogate_loss`, the user's
            gradients, random-number generators and buffers left as they were.
    """

    def __init__(self, model: nn.Module, repeats: int, workload: Workload | None = None):
        super().__init__(model, [workload.optimizer] if workload is not None else ())
        self.repeats, self.workload = repeats, workload
        self.inputs: tuple[tuple, dict] | None = None
        self.autocast: tuple[bool, torch.dtype] | None = None
        self.passes: list[tuple[str, ...]] | None = None  # the isolated passes' modules, once decided
        self.parts: list[IsolatedMeasurements] = []  # this rank's figures of the passes run so far
        self.isolated_figures: IsolatedMeasurements | None = None  # every pass's, once the last has run
        self._isolation_s = 0.0

    def _root_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        super()._root_forward(module, args, kwargs)
        if self.workload is None and self.inputs is None:
            self.inputs = (_detached(args), _detached(kwargs))
            kind = "cuda" if self.device == "cuda" else "cpu"
            self.autocast = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))

    @staticmethod
    def loop_steps(config: StudyConfig) -> list[RoundStep]:
        """A user's loop's first recording steps, in :func:`record_profile`'s order: warm-up steps (the optimizer
        state exists before its bytes are counted), then the peak steps (the isolated passes' budget reads them)."""
        warmup = max(1, config.measure.warmup_steps)
        return [RoundStep(RECORD_WARMUP, 0)] * warmup + [RoundStep(RECORD_PEAK, 0)] * PEAK_STEPS

    def loop_next(self, config: StudyConfig, gather: Callable[[Any], list[Any]]) -> list[RoundStep]:
        """A user's loop, its queued recording steps run (collective: every rank, between two steps): the steps to
        run next, ``[]`` once the profile's figures are all in (:meth:`profile` of :attr:`isolated_figures`).

        In :func:`record_profile`'s order: the next isolated pass (:meth:`isolate_next`), then one untimed step while
        passes remain; after the last, one untimed step (what a pass leaves behind washes out) and the timed steps of
        FSDP2's default, last and warm, in the process state the race then runs in.
        """
        if self.isolated_figures is not None:
            return []
        self.isolated_figures = self.isolate_next(config.search.budget(), gather)
        timed = []
        if self.isolated_figures is not None:
            timed = [RoundStep(RECORD, 0)] * config.measure.steps
            if traces_collectives(config.measure.collectives, self.device):
                timed += [RoundStep(RECORD_TRACE, 0)] * TRACED_STEPS
        return [RoundStep(RECORD_WARMUP, 0)] + timed

    def isolate_next(self, budget: MemoryBudget | None,
                     gather: Callable[[Any], list[Any]]) -> IsolatedMeasurements | None:
        """The next isolated pass (collective: every rank calls it, after FSDP2's default's peak steps, between two
        steps): this rank's isolated figures of every module once the last pass has run
        (:func:`runtime.recording.consolidation.merge_isolated`), else ``None``. The first call decides the passes
        from the recorded peaks, the tightest rank's device memory and ``budget``
        (:func:`planner.study.isolation.isolation_groups`: all modules at once, or a few at a time) and also times
        the collectives.

        Args:
            budget: the study's memory budget (``None``: none).
            gather: every rank's object, by rank (``runtime.ranks.collectives.gather_objects`` on the control group).

        Raises:
            PlannerError: a single module does not fit under the limit; as :meth:`isolated`; the passes disagree
                on the post-forward order.
        """
        device = device_of(self.device)
        t0 = device.clock()
        if self.passes is None:  # the same on every rank: every figure in it is
            capacity = tightest_capacity(device, gather)
            default_peak = max(gather(max(self.peaks)))
            fp = model_fingerprint(self.model)
            modules = list(zip(fp.module_fqns, fp.param_bytes, strict=True))
            limit = isolation_limit(budget, capacity, default_peak)
            self.passes = isolation_groups(limit, default_peak, modules, sum(fp.param_bytes) // fp.shard_size)
        held = self.passes[len(self.parts)]
        self.parts.append(self.isolated(only=None if len(self.passes) == 1 else held, collectives=not self.parts))
        self._isolation_s += device.clock() - t0
        if len(self.parts) < len(self.passes):
            return None
        device.release_cache()  # the passes' blocks, sized for modules held unsharded together
        try:
            return merge_isolated(self.parts)
        except ValueError as e:
            raise PlannerError(str(e)) from None

    @property
    def isolation(self) -> str:
        """What the isolated passes cost, for the log: seconds between steps, and how many passes."""
        passes = self.passes or []
        return f"isolated passes {self._isolation_s:.1f} s between steps" + (
            f", {len(passes)} passes of at most {max(map(len, passes))} module(s) each (the memory they may reach)"
            if len(passes) > 1 else "")

    def isolated(self, only: tuple[str, ...] | None = None, collectives: bool = True) -> IsolatedMeasurements:
        """This rank's isolated figures (collective: every rank calls it, between two steps;
        :func:`runtime.recording.isolated.isolated_measurements`, ``only`` and ``collectives`` as it takes them).

        Raises:
            PlannerError: a user's loop: no forward was seen yet, or the forward returns nothing to backpropagate.
        """
        resharding = {fqn: reshard_after_forward(m) for fqn, m in fsdp_modules(self.model)}
        fingerprint = model_fingerprint(self.model, dist.get_world_size())
        if self.workload is not None:
            return isolated_measurements(self.workload, fingerprint, self.repeats, self.device, resharding,
                                         only=only, collectives=collectives)
        if self.inputs is None:
            raise PlannerError("the in-loop recorder saw no forward of the root module inside tuner.step()")
        args, kwargs = self.inputs
        enabled, dtype = self.autocast

        def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
            with torch.autocast("cuda" if self.device == "cuda" else "cpu", dtype=dtype, enabled=enabled):
                return surrogate_loss(model(*batch[0], **batch[1]))

        workload = Workload(self.model, self.optimizers[0] if self.optimizers else None, lambda s: (args, kwargs),
                            loss_fn)
        buffers = {name: b.detach().clone() for name, b in self.model.named_buffers()}
        devices = [torch.cuda.current_device()] if self.device == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            figures = isolated_measurements(workload, fingerprint, self.repeats, self.device, resharding,
                                            zero_grad=False, only=only, collectives=collectives)
        with torch.no_grad():
            for name, b in self.model.named_buffers():
                b.copy_(buffers[name])
        return figures

    def profile(self, isolated: IsolatedMeasurements, gather: Callable[[Any], list[Any]],
                microbatches: int | None = None, **more: Any) -> Profile:
        """The profile from this rank's steps and ``isolated`` figures and every other rank's (collective).

        Args:
            gather: every rank's object, by rank (``runtime.ranks.collectives.gather_objects``).
            microbatches: the workload's microbatches per step; ``None``: the root's forwards per step, as counted.
            more: the step figures the recorder does not read itself (:func:`_default_plan_steps`).

        Raises:
            PlannerError: no timed step or no peak was recorded, or the ranks disagree on the post-forward order.
        """
        local = RankMeasurements(dist.get_rank(), self.measurements(**more), isolated)
        calls = self.read_collectives()
        modules = fsdp_modules(self.model)
        resharding = {fqn: reshard_after_forward(m) for fqn, m in modules}
        if microbatches is None:
            microbatches = max(1, statistics.median_low(self.microbatches))
        gathered = gather((local, calls))
        try:
            profile = consolidate([g[0] for g in gathered], model_fingerprint(self.model, dist.get_world_size()),
                                  resharding, isolated.calls, microbatches, parameter_rows(modules))
        except RuntimeError as e:
            raise PlannerError(str(e)) from None
        traced = [g[1] for g in gathered]
        if dist.get_world_size() > 1 and all(traced):
            try:
                profile = with_in_step_collectives(profile, in_step_collectives(traced), TRACED_STEPS)
            except ValueError as e:
                logger.warning(f"the traced collectives did not pair up across ranks ({e}); their isolated times "
                               "stand")
        return profile


def record_profile(workload: Workload, warmup_steps: int = 2, steps: int = 3, repeats: int = 3,
                   budget: MemoryBudget | None = None, per_module: bool = False, collectives: str = AUTO) -> Profile:
    """Record a :class:`Profile` on every rank (collective: all ranks call it).

    The steps, in order: ``warmup_steps`` untimed steps; FSDP2's default's peak steps; the isolated passes, as
    many as the memory they may reach asks for ([Note: Profiling within the device's memory] in
    ``planner.study.isolation``); one untimed step, which washes out what the passes left; on CPU at world size 2
    or more, pairs of the default and the async default in turn; the ``steps`` timed steps last
    (:func:`_default_plan_steps`). The in-loop tuner runs the same order, one pass between two of the user's steps.

    Args:
        workload: this rank's workload; its model must not have run a plan
            other than FSDP2's default.
        warmup_steps: untimed default-plan steps first.
        steps: timed default-plan steps (step ms, optimizer ms), run last.
        repeats: repeats of each compute and communication measurement
            (medians are kept; one extra warm-up repeat is dropped).
        budget: the study's memory budget (``[search] memory_budget``), which the passes also keep to.
        per_module: every pass holds one module unsharded, whatever the memory allows (``bench.trace_profile``
            compares the two).
        collectives: ``[measure] collectives``: where the all-gathers and reduce-scatters are timed (``"auto"``:
            inside traced steps on a GPU, in isolation on CPU; ``runtime.recording.collective_trace``).

    Returns:
        The consolidated profile (the same on every rank). Times in ms,
        sizes in bytes.

    Raises:
        PlannerError: a single module does not fit in the memory the passes may reach, or as
            :meth:`Recorder.isolate_next`.
    """
    recorder = Recorder(workload.model, repeats, workload)
    try:
        for s in range(warmup_steps):  # the optimizer state exists before its bytes are counted
            train_step(workload, s)
        runner = _peak_steps(workload, recorder)
        if per_module:
            recorder.passes = [(fqn,) for fqn, _ in fsdp_modules(workload.model)]
        isolated = None
        while isolated is None:
            isolated = recorder.isolate_next(budget, gather_objects)
        runner.run_all([RoundStep(RECORD_WARMUP, 0)])
        more = _default_plan_steps(runner, steps, traces_collectives(collectives, recorder.device))
        recorder.read_collectives()  # before remove(), which drops a trace still running
    finally:
        recorder.remove()
    return recorder.profile(isolated, gather_objects, workload.microbatches, **more)
