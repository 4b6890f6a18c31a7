"""The simulator's numeric kernel: one FSDP2 step over per-module arrays, compiled by numba.

Written as plain loops over NumPy arrays so numba can compile it
(``@njit``); without numba it runs as ordinary Python, same results. One
file per part, as FSDP2 splits its own: :mod:`~planner._kernel.state` (the
input bundles, the step's state and the names of its slots),
:mod:`~planner._kernel.timeline` (time and memory accounting),
:mod:`~planner._kernel.param_group` (unshard, wait, reshard, reduce-scatter)
and :mod:`~planner._kernel.hooks` (the hooks of one step, and
:func:`~planner._kernel.hooks.step`). ``planner.simulator`` is its only caller.
"""

from planner._kernel.hooks import step
from planner._kernel.state import KernelParams, PlanArrays, ProfileArrays

__all__ = ["KernelParams", "PlanArrays", "ProfileArrays", "step"]
