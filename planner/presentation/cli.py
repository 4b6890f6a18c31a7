"""The ``prefetch-planner`` commands that need no ranks: ``simulate`` and ``studies``; a thin layer over the Python API.

They never import torch. The full command line (these plus ``tune`` and
``profile``, which run on ranks) is ``jobs.cli``; ``python -m planner.presentation.cli``
runs these alone, where torch is absent. Every bad input prints one line
``error: ...`` to stderr and exits 2.
"""

from __future__ import annotations

import click

from planner.presentation.options import CONTEXT_SETTINGS, PlannerGroup
from planner.presentation.simulate_command import presets_command, simulate
from planner.presentation.studies_command import studies


@click.group(cls=PlannerGroup, context_settings=CONTEXT_SETTINGS)
def main() -> None:
    """Simulate plans and query studies (the commands that need no ranks; the full CLI is `prefetch-planner`)."""


main.add_command(simulate)
main.add_command(studies)
main.add_command(presets_command)

if __name__ == "__main__":
    main()
