"""Timing real training steps: one step, and several plans interleaved.

Step ms for a plan is the median over measured steps of the max across ranks
(docs/architecture.md, "Measurement"). Plans are interleaved A B A B ... in one run so that
machine noise hits them alike.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from planner.artifacts.plan import Plan
from runtime.apply import apply_plan
from runtime.workload import Workload, train_step


def synchronize(device_type: str) -> None:
    """Wait for the device (no-op on CPU, where compute is synchronous)."""
    if device_type == "cuda":
        torch.cuda.synchronize()


def device_type_of(workload: Workload) -> str:
    """``"cpu"`` or ``"cuda"``: where the model's parameters live."""
    return next(workload.model.parameters()).device.type


def timed_step(workload: Workload, step: int) -> float:
    """Run one training step after a barrier; return this rank's wall time in ms."""
    device = device_type_of(workload)
    dist.barrier()
    synchronize(device)
    t0 = time.perf_counter()
    train_step(workload, step)
    synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def max_across_ranks(local: list[float]) -> tuple[list[float], list[list[float]]]:
    """Gather a per-step list from every rank (``all_gather_object``).

    Returns:
        ``(max per step across ranks, per-rank lists)``.
    """
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return [max(vals) for vals in zip(*gathered)], gathered


class StepFailed(Exception):
    """A training step raised while measuring plan ``index`` (``__cause__`` is the exception)."""

    def __init__(self, index: int, error: BaseException):
        super().__init__(f"plan {index}: {type(error).__name__}: {error}")
        self.index = index
        self.error = error


class StepCounter:
    """The global step index: each training step draws ``make_batch(index)``; every rank counts alike."""

    def __init__(self) -> None:
        self.index = 0

    def next(self) -> int:
        """The index of the step about to run."""
        self.index += 1
        return self.index - 1


def warm_up(
    workload: Workload,
    plans: Sequence[Plan],
    warmup_steps: int,
    steps: StepCounter,
    on_step: Callable[[], None] | None = None,
) -> None:
    """Apply each plan (checked before) and run ``warmup_steps`` untimed steps with it.

    Raises:
        StepFailed: a step raised; names the plan.
    """
    index = 0
    try:
        for index, plan in enumerate(plans):
            apply_plan(workload.model, plan, check=False)
            for _ in range(warmup_steps):
                train_step(workload, steps.next())
                if on_step is not None:
                    on_step()
    except Exception as e:
        raise StepFailed(index, e) from e


def run_block(
    workload: Workload,
    plans: Sequence[Plan],
    block: list[list[int]],
    steps: StepCounter,
    on_step: Callable[[], None] | None = None,
) -> list[list[float]]:
    """This rank's step times of a block of rounds (all ranks call this with the same block).

    Args:
        plans: the plans, indexed by the block.
        block: per round, the plan indices in running order; each step applies
            its plan first (a plan's settings are switched between steps).

    Returns:
        Per round, per position, this rank's step time, ms.

    Raises:
        StepFailed: a step raised; names the plan.
    """
    out = []
    index = 0
    try:
        for order in block:
            times = []
            for index in order:
                apply_plan(workload.model, plans[index], check=False)
                times.append(timed_step(workload, steps.next()))
                if on_step is not None:
                    on_step()
            out.append(times)
    except Exception as e:
        raise StepFailed(index, e) from e
    return out


def measure_local(
    workload: Workload,
    plans: Sequence[Plan],
    rounds: int,
    warmup_steps: int = 1,
    on_step: Callable[[], None] | None = None,
) -> list[list[float]]:
    """This rank's step times for ``plans``, interleaved A B C A B C ... (all ranks call this with the same plans).

    Each plan is first warmed up (:func:`warm_up`); then ``rounds`` rounds each
    run one timed step per plan in order.

    Returns:
        ``times[i]``: plan ``i``'s step times on this rank, ms.

    Raises:
        StepFailed: a step raised an ``Exception``; names the plan.
    """
    steps = StepCounter()
    warm_up(workload, plans, warmup_steps, steps, on_step)
    block = run_block(workload, plans, [list(range(len(plans)))] * rounds, steps, on_step)
    return [[times[i] for times in block] for i in range(len(plans))]


def measure_plans(
    workload: Workload,
    plans: Sequence[Plan],
    rounds: int,
    warmup_steps: int = 1,
    on_step: Callable[[], None] | None = None,
) -> tuple[list[list[float]], list[list[list[float]]]]:
    """:func:`measure_local`, then the max across ranks (for benchmarks; the study uses ``runtime.protocol``).

    Returns:
        ``(step_ms, per_rank)``: ``step_ms[i]`` lists plan ``i``'s step times
        (max across ranks, ms); ``per_rank[i][r]`` rank ``r``'s own times.
    """
    local = measure_local(workload, plans, rounds, warmup_steps, on_step)
    flat = [ms for times in local for ms in times]
    maxed, gathered = max_across_ranks(flat)
    step_ms = [maxed[i * rounds : (i + 1) * rounds] for i in range(len(plans))]
    per_rank = [[g[i * rounds : (i + 1) * rounds] for g in gathered] for i in range(len(plans))]
    return step_ms, per_rank
