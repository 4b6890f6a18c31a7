"""What the rank-running benches share: run a study's ranks on this script, or be one of them."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable


def add_saved_run_arguments(parser: argparse.ArgumentParser) -> None:
    """``--json`` (write the run of the single study there) and ``--refit`` (report saved runs again)."""
    parser.add_argument("--json", help="write the run of the (single) study here")
    parser.add_argument("--refit", nargs="+", metavar="JSON", help="report saved --json runs again, measuring nothing")


def refitted(args: argparse.Namespace, report: Callable[[dict], object]) -> bool:
    """With ``--refit``: ``report`` each saved run and return ``True`` (nothing to measure); else ``False``."""
    for path in args.refit or ():
        report(json.loads(Path(path).read_text()))
    return bool(args.refit)


def run_studies(script: str, studies: list[str], forward: Callable[[str], list[str]], rank_main: Callable[[], None]
                ) -> None:
    """Under torchrun, call ``rank_main()``; else launch each study's ranks on ``script`` with ``forward(study)``.

    Exits with the first failing rank's code, or 2 with one line on a ``PlannerError`` (e.g. a bad study TOML).
    """
    from planner.artifacts.config import load_study_config
    from planner.errors import PlannerError
    from runtime.launch import in_torchrun, launch_ranks

    try:
        if in_torchrun():
            rank_main()
            return
        for study in studies:
            code = launch_ranks(forward(study), load_study_config(study).launch.nproc_per_node, script=script)
            if code:
                sys.exit(code)
    except PlannerError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
