"""Benchmarks that print figures: ``python -m bench.NAME --help``.

Speed, memory and fidelity targets live here, not in timed unit tests. What
the benches measured is kept in ``bench/results/`` as dated markdown reports
(workload, hardware, versions, command, table), which the docs' accuracy page
quotes.
"""
