"""Which global parameters a profile is simulated with, and the simulator that uses them.

A profile carries a calibration once one was fitted and accepted
(:mod:`planner.simulation.calibrate`); before that its parameters are solved
from its in-step timings (:mod:`planner.simulation.in_step`). Callers that
simulate one profile many times build one :class:`Simulator` with
:func:`simulator_for` and keep it; :func:`simulate` is the one-off form.
"""

from __future__ import annotations

from planner.artifacts.plan import Plan
from planner.artifacts.profile import Profile
from planner.simulation.in_step import in_step_params
from planner.simulation.simulator import SimParams, SimResult, Simulator


def profile_params(profile: Profile) -> SimParams:
    """The profile's calibration if it has one, else the parameters solved from its in-step timings."""
    if profile.calibration:
        return SimParams(**profile.calibration)
    return in_step_params(profile)


def simulator_for(profile: Profile, params: SimParams | None = None) -> Simulator:
    """A :class:`Simulator` of ``profile`` with ``params``, by default :func:`profile_params`."""
    return Simulator(profile, params if params is not None else profile_params(profile))


def simulate(profile: Profile, plan: Plan, params: SimParams | None = None, trace: bool = False) -> SimResult:
    """Predict one plan on ``profile``: ``simulator_for(profile, params).run(plan, trace=trace)``.

    Builds the profile's arrays (and, without ``params``, solves its in-step
    parameters) on every call: to simulate many plans, keep a
    :func:`simulator_for` instead.

    Raises:
        KeyError: the plan names a module the profile does not have.
    """
    return simulator_for(profile, params).run(plan, trace=trace)
