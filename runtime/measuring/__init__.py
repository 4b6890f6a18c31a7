"""Measuring: plans timed against each other on the real ranks.

:mod:`~runtime.measuring.round` (the measured round every rank holds, ``MeasuredRound``: the rank protocol) and
:mod:`~runtime.measuring.measure` (the workload's drivers of a round: the tune job's, ``measured_round``, and a round
of fixed plans, ``measure_plans``), their steps run by the one step runner, :mod:`runtime.recording.steps`.
"""
