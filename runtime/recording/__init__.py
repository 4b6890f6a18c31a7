"""Recording: what a step of FSDP2's default costs, module by module, on each rank.

The timers (:mod:`~runtime.recording.compute_timer`, :mod:`~runtime.recording.collective_timer`,
:mod:`~runtime.recording.overlap_timer`) and the memory readers (:mod:`~runtime.recording.mark_memory`,
:mod:`~runtime.recording.peak_memory`, :mod:`~runtime.recording.memory`,
:mod:`~runtime.recording.process_usage`) give typed figures (``planner.artifacts.rank_measurements``);
:mod:`~runtime.recording.steps` is the one step runner (``StepSide``: every step of the tune job, its launches
and the in-loop tuner, timed and metered), :mod:`~runtime.recording.step_figures` reads FSDP2's default steps for
a profile, :mod:`~runtime.recording.recorder` runs them on a study's ranks, and
:mod:`~runtime.recording.consolidation` merges the ranks into a ``Profile``. The recorder
(:class:`~runtime.recording.recorder.Recorder`) serves the in-loop tuner, on the user's own steps, too.
"""
