"""The in-loop tuner: tuning on the user's own training steps.

:mod:`~runtime.in_loop.autotuner` (``AutoTuner``, its face: ``tuner.step()`` around each of the user's steps),
:mod:`~runtime.in_loop.round` (what happens between two steps: the tuning session on rank 0, and the measured
round, ``runtime.measuring.round``, driven with the user's steps through the one step runner,
``runtime.recording.steps``) and :mod:`~runtime.in_loop.watching` (the survivor watched); the profile is recorded
on the user's steps by the one recorder, ``runtime.recording.recorder.Recorder``. Its decisions are torch-free, in
:mod:`planner.study.in_loop`; the tuning session is opened as ``tune`` opens it
(:func:`search_spaces.session.open_session`).
"""
