"""The jobs: composition roots that wire ``runtime`` (ranks, FSDP2) to ``planner`` (study, simulator).

``planner`` never imports ``runtime``; what needs both lives here, one job
per file: :mod:`jobs.tune` (``prefetch-planner tune``), :mod:`jobs.profile`
(``prefetch-planner profile``), and the command line that starts them,
:mod:`jobs.cli`.
"""

# The loggers whose records are the jobs' progress: rank 0 prints them (``jobs.cli``), and the tune job routes them
# through its progress bar while the bar is drawn (``jobs.tune``).
PROGRESS_LOGGERS = ("jobs", "planner", "runtime")
