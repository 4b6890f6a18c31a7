"""Profiles from ``torch.profiler`` traces: :mod:`~planner.traces.kineto` reads one rank's file,
:mod:`~planner.traces.fsdp_steps` finds FSDP2's work in it, :mod:`~planner.traces.trace_profile` builds the
:class:`~planner.artifacts.profile.Profile` from every rank's."""
