"""How much compute and an all-gather slow each other when they run at once on a CPU device.

On CPU, gloo runs a collective in its own threads on the same cores as the
training step's compute. With ``unshard_async_op=True`` an all-gather runs
beside forward or backward compute, and both slow down. The simulator models
this with one parameter, ``overlap_slowdown`` (:class:`planner.simulation.simulator.SimParams`):
while both run, both progress at ``1 / overlap_slowdown`` of their speed, so
compute of ``C`` ms beside an all-gather of ``M`` ms takes
``max(C, M) + min(C, M) * (overlap_slowdown - 1)``. This module measures the
three times the parameter is solved from (:mod:`planner.simulation.in_step`), on the
module with the most unsharded parameters, with matrix multiplies as the
compute (:func:`overlap_timings`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
from torch.distributed.fsdp import FSDPModule

from planner.artifacts.rank_measurements import OverlapTimings
from runtime.ranks.device import device_of

# The compute beside the all-gather: (rows x inner) @ (inner x inner) float32 matrix multiplies.
_ROWS, _INNER = 64, 1024


def _cpu_ms(run: Callable[[], object]) -> float:
    return device_of("cpu").timed_ms(run)


def _matmuls(count: int, a: torch.Tensor, b: torch.Tensor) -> None:
    for _ in range(count):
        torch.mm(a, b)




def overlap_timings(modules: list[tuple[str, FSDPModule]], unsharded_numels: dict[str, int],
                    all_gather_ms: dict[str, float], repeats: int = 5) -> OverlapTimings:
    """Compute alone, all-gather alone, and both at once, interleaved over ``repeats`` rounds (CPU device).

    Every rank calls this together. The all-gather is ``module.unshard()``
    (all-gather and copy-out, as :func:`runtime.recording.collective_timer.all_gather_ms`
    times it) of the module with the most unsharded parameters; the compute is
    as many matrix multiplies as this rank's ``all_gather_ms`` of it. "Both" issues
    ``module.unshard(async_op=True)``, runs the compute, then waits on the
    handle, as FSDP2 does with ``unshard_async_op=True``.

    Args:
        modules: the FSDP modules, ``(fqn, module)``, all resharded.
        unsharded_numels: unsharded parameter elements per FQN, the same on
            every rank: chooses the module (a choice by this rank's timings
            could differ between ranks and mismatch the collectives).
        all_gather_ms: this rank's isolated all-gather ms per FQN (sizes the compute).
        repeats: rounds; each round times the three in a rotated order.

    Returns:
        Medians over the rounds, this rank's wall times, ms.
    """
    fqn = max(unsharded_numels, key=lambda f: unsharded_numels[f])  # the first of equals: the same on every rank
    module = dict(modules)[fqn]
    a, b = torch.randn(_ROWS, _INNER), torch.randn(_INNER, _INNER)
    one = statistics.median(_cpu_ms(lambda: _matmuls(4, a, b)) / 4 for _ in range(5))
    count = max(1, round(all_gather_ms[fqn] / max(one, 1e-3)))

    def gather() -> None:
        module.unshard()

    def both() -> None:
        handle = module.unshard(async_op=True)
        _matmuls(count, a, b)
        if handle is not None:
            handle.wait()

    runs = {"all_gather_ms": gather, "compute_ms": lambda: _matmuls(count, a, b), "overlapped_ms": both}
    names = list(runs)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats + 1):  # the first round warms up and is dropped
        for name in names[r % 3:] + names[:r % 3]:
            ms = _cpu_ms(runs[name])
            module.reshard()
            if r:
                samples[name].append(ms)
    return OverlapTimings(fqn, **{n: statistics.median(v) for n, v in samples.items()})
