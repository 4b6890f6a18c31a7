"""Benchmarks that print figures: ``python -m bench.NAME --help``.

Speed, memory and fidelity targets live here, not in timed unit tests. What
the benches measured, and when, is kept in ``bench/results/`` (``NOTES.md``
and the saved ``--json`` runs).
"""
