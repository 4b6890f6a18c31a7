"""Measuring: plans timed against each other on the real ranks.

:mod:`~runtime.measuring.measure` (timed steps and the one measured-round loop, ``run_schedule``),
:mod:`~runtime.measuring.protocol` (the rank protocol of a measured round: failures, timeouts, interrupts) and
:mod:`~runtime.measuring.in_loop_round` (what the in-loop tuner does between two of the user's steps).
"""
