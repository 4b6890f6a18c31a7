"""``prefetch-planner profile --from-trace``: a profile from a job's own ``torch.profiler`` traces, no ranks run."""

from __future__ import annotations

import dataclasses
import json

from jobs.outputs import check_output_folders
from planner.artifacts.plan import Plan
from planner.errors import PlannerError, WorkloadError
from planner.simulation.parameters import simulate
from planner.traces.kineto import read_trace, trace_files
from planner.traces.trace_profile import TraceProfile, profile_from_traces


def profile_from_trace(paths: list[str], output: str, model: str | None = None, model_kwargs: str | None = None
                       ) -> tuple[TraceProfile, float]:
    """Build the profile from ``paths`` and write it to ``output``.

    Args:
        model: ``package.module:function``, the traced job's workload factory: its model, built on a fake
            world of the traces' size (``runtime.fake_world``), gives the parameter counts; ``None``: estimated.
        model_kwargs: the factory's keyword arguments, a JSON object.

    Returns:
        The trace profile, and FSDP2's default plan's simulated step on it from the profile's figures alone (without
        the in-step parameters, which are solved from the traced step itself and would meet it by construction), ms.

    Raises:
        TraceFormatError: as :func:`planner.traces.trace_profile.profile_from_traces`.
        WorkloadError: ``model_kwargs`` is not a JSON object, or the factory fails.
        PlannerError: the output's folder does not exist.
    """
    check_output_folders(output)
    fingerprint = None
    if model is not None:
        try:
            kwargs = json.loads(model_kwargs or "{}")
        except json.JSONDecodeError as e:
            raise WorkloadError(f"--model-kwargs is not JSON ({e}); give an object, e.g. '{{\"layers\": 8}}'") from None
        if not isinstance(kwargs, dict):
            raise WorkloadError(f"--model-kwargs must be a JSON object, found {model_kwargs!r}")
        files = trace_files(paths)
        world = next((t.world_size for t in map(read_trace, files[:1]) if t.world_size), len(files))
        from runtime.fake_world import workload_fingerprint

        fingerprint = workload_fingerprint(model, kwargs, world)
    traced = profile_from_traces(paths, fingerprint)
    if fingerprint is not None:  # the fake world builds on the CPU; the traces say where the job ran
        device = traced.profile.fingerprint.device_type
        traced = dataclasses.replace(traced, profile=dataclasses.replace(
            traced.profile, fingerprint=dataclasses.replace(fingerprint, device_type=device)))
    try:
        traced.profile.to_json(output)
    except OSError as e:
        raise PlannerError(f"cannot write {output!r}: {e.strerror}") from None
    alone = dataclasses.replace(traced.profile, in_step=None)
    return traced, simulate(alone, Plan.default(alone)).step_ms
