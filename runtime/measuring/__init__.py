"""Measuring: plans timed against each other on the real ranks.

:mod:`~runtime.measuring.measure` (timed steps and the one measured-round loop, ``run_schedule``) and
:mod:`~runtime.measuring.protocol` (the rank protocol of a measured round: failures, timeouts, interrupts).
"""
