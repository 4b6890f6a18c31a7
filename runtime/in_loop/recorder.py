"""The recorder on a user's own training steps: the same Profile as ``runtime.recording.recorder``, without a workload
factory.

``runtime.AutoTuner`` runs FSDP2's default for its first steps and records
them here ([Note: Tuning on the user's steps] in :mod:`planner.study.in_loop`):

- step ms: the user's steps, timed by the tuner (after a barrier, to the
  step's end), median over the timed steps; optimizer ms: from the first
  ``optimizer.step()`` to the last one's end in a step (global optimizer
  hooks, ``register_optimizer_step_pre_hook``);
- microbatches: root forwards per step (gradient accumulation in the user's
  loop);
- peak bytes: steps run under :mod:`runtime.recording.peak_memory`'s measurement
  (CPU: the profiler's allocation events plus the bytes alive at the step's
  start; GPU: ``max_memory_allocated``); those steps are not timed;
- between steps: the recorder's isolated figures
  (:func:`runtime.recording.recorder.isolated_measurements`: per-module compute with every
  module unsharded and no communication, all-gather and reduce-scatter in
  isolation, the overlap microbenchmark) on the first step's inputs with a
  surrogate loss, leaving the user's gradients, random-number generators
  and buffers as they were. Where the memory budget cannot hold every
  module unsharded at once, a few modules at a time, one pass between two
  steps (:meth:`LoopRecorder.isolate_next`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.profiler import ProfilerActivity, profile, record_function

from planner.artifacts.config import StudyConfig
from planner.artifacts.profile import Profile
from planner.artifacts.rank_measurements import IsolatedMeasurements, RankMeasurements, StepMeasurements
from planner.errors import PlannerError
from planner.study.in_loop import isolation_groups
from runtime.apply import model_fingerprint
from runtime.ranks.device import device_of
from runtime.ranks.torch_private import profiler_allocations, reshard_after_forward
from runtime.recording.compute_timer import tensors_in
from runtime.recording.consolidation import consolidate, merge_isolated
from runtime.recording.peak_memory import OPTIMIZER_BLOCK, bytes_alive, stderr_silenced, step_peak
from runtime.recording.recorder import isolated_measurements, optimizer_state_bytes
from runtime.workload import Workload, fsdp_modules, parameter_rows


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
    user's (the same graph), for the isolated compute windows.

    Raises:
        PlannerError: the forward returned no tensor that requires grad.
    """
    tensors = [t for t in tensors_in(output) if t.is_floating_point() and t.requires_grad]
    if not tensors:
        raise PlannerError("the model's forward returned no floating-point tensor that requires grad; the in-loop "
                           "recorder cannot run a backward pass on it")
    return sum(t.float().sum() for t in tensors)


class PeakMeter:
    """One rank's peak memory in a user's step, as :func:`runtime.recording.peak_memory.measure_peak` measures it.

    CPU: the step runs under ``torch.profiler.profile(profile_memory=True)``; the peak is the bytes alive at its
    start (parameters, gradients, the state of ``optimizers``) plus the profiler's peak above that. GPU:
    ``max_memory_allocated`` after ``reset_peak_memory_stats``. Such a step is never a timed one.

    Args:
        model: the root FSDP module.
        optimizers: the optimizers seen so far (a list the caller keeps filling).
    """

    def __init__(self, model: nn.Module, optimizers: list[torch.optim.Optimizer]):
        self.model, self.optimizers = model, optimizers
        self.device = next(model.parameters()).device.type
        self.measuring = False
        self._prof: Any = None
        self._start_bytes = 0

    @property
    def profiling(self) -> bool:
        """The CPU profiler runs (an optimizer step may mark its block)."""
        return self._prof is not None

    def begin(self) -> None:
        """Before the step."""
        self.measuring = True
        device = device_of(self.device)
        device.synchronize()
        if device.type == "cuda":
            device.reset_peak()
            return
        self._start_bytes = bytes_alive(self.model, self.optimizers)
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with stderr_silenced():  # [Note: Kineto's start and stop lines] in runtime.recording.peak_memory
            self._prof.__enter__()

    def end(self) -> tuple[int, int]:
        """After the step: ``(peak bytes, bytes the optimizer step allocated at its peak)`` (GPU: the second is 0)."""
        self.measuring = False
        device = device_of(self.device)
        device.synchronize()
        if device.type == "cuda":
            return device.peak_allocated(), 0
        with stderr_silenced():
            self._prof.__exit__(None, None, None)
        prof, self._prof = self._prof, None
        return (self._start_bytes + step_peak(profiler_allocations(prof)),
                step_peak(profiler_allocations(prof, within=OPTIMIZER_BLOCK)))


class LoopRecorder:
    """Hooks on the user's model and optimizers while FSDP2's default runs, and the isolated passes between steps.

    Args:
        model: the root FSDP module.
        repeats: repeats of each isolated measurement (medians; one warm-up repeat dropped).
    """

    def __init__(self, model: nn.Module, repeats: int):
        self.model, self.repeats = model, repeats
        self.device = next(model.parameters()).device.type
        self.inputs: tuple[tuple, dict] | None = None
        self.autocast: tuple[bool, torch.dtype] | None = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.forwards = 0
        self.microbatches: list[int] = []
        self.step_ms: list[float] = []
        self.optimizer_ms: list[float] = []
        self.peaks: list[int] = []
        self.optimizer_temp: list[int] = []
        self._opt_start: float | None = None
        self._opt_end: float | None = None
        self._opt_block: Any = None
        self.meter = PeakMeter(model, self.optimizers)
        self.passes: list[tuple[str, ...]] | None = None  # the isolated passes' modules, once decided
        self.parts: list[IsolatedMeasurements] = []  # this rank's figures of the passes run so far
        self._isolation_s = 0.0
        self._handles = [
            model.register_forward_pre_hook(self._root_forward, with_kwargs=True),
            register_optimizer_step_pre_hook(self._optimizer_pre),
            register_optimizer_step_post_hook(self._optimizer_post),
        ]

    def _root_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.forwards += 1
        if self.inputs is None:
            self.inputs = (_detached(args), _detached(kwargs))
            kind = "cuda" if self.device == "cuda" else "cpu"
            self.autocast = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))

    def _optimizer_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not any(o is optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)
        device = device_of(self.device)
        device.synchronize()
        if self._opt_start is None:
            self._opt_start = device.clock()
        if self.meter.profiling and self._opt_block is None:
            self._opt_block = record_function(OPTIMIZER_BLOCK)
            self._opt_block.__enter__()

    def _optimizer_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        device = device_of(self.device)
        device.synchronize()
        self._opt_end = device.clock()

    def begin_step(self, peak: bool) -> None:
        """Before a user's step (every rank); ``peak``: measure its peak memory (the step is then not timed)."""
        self.forwards = 0
        self._opt_start = self._opt_end = None
        if peak:
            self.meter.begin()

    def end_step(self, step_ms: float | None) -> None:
        """After a user's step: ``step_ms`` this rank's time of a timed step, ``None`` for an untimed one."""
        self.microbatches.append(self.forwards)
        if self._opt_block is not None:
            self._opt_block.__exit__(None, None, None)
            self._opt_block = None
        if step_ms is not None:
            self.step_ms.append(step_ms)
            if self._opt_start is not None and self._opt_end is not None:
                self.optimizer_ms.append((self._opt_end - self._opt_start) * 1e3)
        if self.meter.measuring:
            peak, optimizer_temp = self.meter.end()
            self.peaks.append(peak)
            self.optimizer_temp.append(optimizer_temp)

    def remove(self) -> None:
        """Remove every hook (the recording is over)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def isolate_next(self, config: StudyConfig, gather: Callable[[Any], list[Any]]) -> IsolatedMeasurements | None:
        """The next isolated pass (collective: every rank calls it, between two steps): this rank's isolated
        figures of every module once the last pass has run (:func:`runtime.recording.recorder.merge_isolated`), else
        ``None``. The first call decides the passes from the recorded peaks and the memory budget
        (:func:`planner.study.in_loop.isolation_groups`: all modules at once, or a few at a time, one pass between
        two steps) and also times the collectives.

        Args:
            config: the in-loop study (its memory budget).
            gather: every rank's object, by rank (``runtime.ranks.collectives.gather_objects`` on the control group).

        Raises:
            PlannerError: a single module does not fit under the budget; as :meth:`isolated`; the passes disagree
                on the post-forward order.
        """
        clock = device_of(self.device).clock
        t0 = clock()
        if self.passes is None:  # the same on every rank: every figure in it is
            default_peak = max(max(p) for p in gather(self.peaks))
            fp = model_fingerprint(self.model)
            modules = list(zip(fp.module_fqns, fp.param_bytes, strict=True))
            self.passes = isolation_groups(config, default_peak, modules, sum(fp.param_bytes) // fp.world_size)
        held = self.passes[len(self.parts)]
        self.parts.append(self.isolated(only=None if len(self.passes) == 1 else held, collectives=not self.parts))
        self._isolation_s += clock() - t0
        if len(self.parts) < len(self.passes):
            return None
        try:
            return merge_isolated(self.parts)
        except ValueError as e:
            raise PlannerError(str(e)) from None

    @property
    def isolation(self) -> str:
        """What the isolated passes cost, for the log: seconds between steps, and how many passes."""
        passes = self.passes or []
        return f"isolated passes {self._isolation_s:.1f} s between steps" + (
            f", {len(passes)} passes of at most {max(map(len, passes))} module(s) each (the memory budget)"
            if len(passes) > 1 else "")

    def isolated(self, only: tuple[str, ...] | None = None, collectives: bool = True) -> IsolatedMeasurements:
        """This rank's isolated figures (collective: every rank calls it, between two steps).

        The user's gradients, random-number generators and buffers are as they were after it. ``only`` and
        ``collectives``: as :func:`runtime.recording.recorder.isolated_measurements` takes them.

        Raises:
            PlannerError: no forward was seen yet, or the forward returns nothing to backpropagate.
        """
        if self.inputs is None:
            raise PlannerError("the in-loop recorder saw no forward of the root module inside tuner.step()")
        args, kwargs = self.inputs
        enabled, dtype = self.autocast

        def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
            with torch.autocast("cuda" if self.device == "cuda" else "cpu", dtype=dtype, enabled=enabled):
                return surrogate_loss(model(*batch[0], **batch[1]))

        workload = Workload(self.model, self.optimizers[0] if self.optimizers else None, lambda s: (args, kwargs),
                            loss_fn)
        modules = fsdp_modules(self.model)
        resharding = {fqn: reshard_after_forward(m) for fqn, m in modules}
        buffers = {name: b.detach().clone() for name, b in self.model.named_buffers()}
        devices = [torch.cuda.current_device()] if self.device == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            figures = isolated_measurements(workload, model_fingerprint(self.model), self.repeats, self.device,
                                            resharding, zero_grad=False, only=only, collectives=collectives)
        with torch.no_grad():
            for name, b in self.model.named_buffers():
                b.copy_(buffers[name])
        return figures

    def profile(self, isolated: IsolatedMeasurements, gather: Callable[[Any], list[Any]]) -> Profile:
        """The profile from this rank's steps and ``isolated`` figures and every other rank's (collective).

        Args:
            gather: every rank's object, by rank (``runtime.ranks.collectives.gather_objects`` on the control group).

        Raises:
            PlannerError: no timed step or no peak was recorded, or the ranks disagree on the post-forward order.
        """
        if not self.step_ms or not self.peaks:
            raise PlannerError("the in-loop recorder has no timed step or no peak-memory step")
        steps = StepMeasurements(step_ms=statistics.median(self.step_ms),
                                 optimizer_ms=statistics.median(self.optimizer_ms) if self.optimizer_ms else 0.0,
                                 peak_bytes=tuple(self.peaks), optimizer_temp_bytes=max(self.optimizer_temp, default=0),
                                 optimizer_state_bytes=sum(optimizer_state_bytes(o) for o in self.optimizers))
        local = RankMeasurements(dist.get_rank(), steps, isolated)
        modules = fsdp_modules(self.model)
        resharding = {fqn: reshard_after_forward(m) for fqn, m in modules}
        microbatches = max(1, statistics.median_low(self.microbatches))
        try:
            return consolidate(gather(local), model_fingerprint(self.model), resharding, isolated.calls, microbatches,
                               parameter_rows(modules))
        except RuntimeError as e:
            raise PlannerError(str(e)) from None
