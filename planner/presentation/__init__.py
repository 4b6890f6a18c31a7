"""Presentation: the commands that need no ranks, the tune report, the Pareto plot."""
