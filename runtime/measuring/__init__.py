"""Measuring: plans timed against each other on the real ranks.

:mod:`~runtime.measuring.round` (the measured round every rank holds, ``MeasuredRound``: the rank protocol),
:mod:`~runtime.measuring.measure` (the workload's steps, and a round of fixed plans, ``run_schedule``) and
:mod:`~runtime.measuring.protocol` (the tune job's driver of the round).
"""
