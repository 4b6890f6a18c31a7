"""Simulation: the discrete-event model of one FSDP2 step, its parameters, their calibration, its timeline."""
