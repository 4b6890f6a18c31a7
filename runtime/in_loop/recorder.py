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

from planner.artifacts.config import StudyConfig
from planner.artifacts.profile import Profile
from planner.artifacts.rank_measurements import IsolatedMeasurements, RankMeasurements
from planner.errors import PlannerError
from planner.study.in_loop import isolation_groups
from runtime.apply import model_fingerprint
from runtime.ranks.device import device_of
from runtime.ranks.torch_private import reshard_after_forward
from runtime.recording.compute_timer import tensors_in
from runtime.recording.consolidation import consolidate, merge_isolated
from runtime.recording.recorder import isolated_measurements
from runtime.recording.step_figures import StepFigures
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


class LoopRecorder(StepFigures):
    """The step figures of the user's steps while FSDP2's default runs (:class:`~runtime.recording.step_figures.
    StepFigures`), the first step's inputs, and the isolated passes between steps.

    Args:
        model: the root FSDP module.
        repeats: repeats of each isolated measurement (medians; one warm-up repeat dropped).
    """

    def __init__(self, model: nn.Module, repeats: int):
        super().__init__(model)
        self.repeats = repeats
        self.inputs: tuple[tuple, dict] | None = None
        self.autocast: tuple[bool, torch.dtype] | None = None
        self.passes: list[tuple[str, ...]] | None = None  # the isolated passes' modules, once decided
        self.parts: list[IsolatedMeasurements] = []  # this rank's figures of the passes run so far
        self._isolation_s = 0.0

    def _root_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        super()._root_forward(module, args, kwargs)
        if self.inputs is None:
            self.inputs = (_detached(args), _detached(kwargs))
            kind = "cuda" if self.device == "cuda" else "cpu"
            self.autocast = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))

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
        steps = self.measurements()
        local = RankMeasurements(dist.get_rank(), steps, isolated)
        modules = fsdp_modules(self.model)
        resharding = {fqn: reshard_after_forward(m) for fqn, m in modules}
        microbatches = max(1, statistics.median_low(self.microbatches))
        try:
            return consolidate(gather(local), model_fingerprint(self.model), resharding, isolated.calls, microbatches,
                               parameter_rows(modules))
        except RuntimeError as e:
            raise PlannerError(str(e)) from None
