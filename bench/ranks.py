"""What the rank-running benches share: start a study's ranks on a bench module, or be one of them."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

DEFAULT_STUDIES = ("studies/llama-cpu.toml", "studies/gpt2-cpu.toml")


def studies_argument(f: Callable[..., Any]) -> Callable[..., Any]:
    """The study TOMLs (default: the two CPU studies)."""
    return click.argument("studies", nargs=-1, type=click.Path(dir_okay=False))(f)


def saved_run_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--json`` (write the run of the single study there) and ``--refit`` (report saved runs again)."""
    f = click.option("--json", "json_out", type=click.Path(dir_okay=False),
                     help="write the run of the (single) study here")(f)
    return click.option("--refit", multiple=True, type=click.Path(exists=True, dir_okay=False), metavar="JSON",
                        help="report a saved --json run again, measuring nothing (repeatable)")(f)


def report_saved(paths: Sequence[str], report: Callable[[dict], object]) -> bool:
    """``report`` each saved run at ``paths``; ``True`` if there were any (nothing to measure)."""
    for path in paths:
        report(json.loads(Path(path).read_text()))
    return bool(paths)


def run_studies(module: str, studies: Sequence[str], forward: Callable[[str], list[str]],
                rank_main: Callable[[str], None]) -> None:
    """Under torchrun, ``rank_main(study)``; else start each study's ranks on ``python -m module forward(study)``.

    Exits with the first failing rank's code, or 2 with one line on a ``PlannerError`` (e.g. a bad study TOML).
    """
    from planner.artifacts.config import load_study_config
    from planner.errors import PlannerError
    from runtime.ranks.launch import in_torchrun, launch_ranks

    studies = list(studies) or list(DEFAULT_STUDIES)
    try:
        if in_torchrun():
            rank_main(studies[0])
            return
        for study in studies:
            code = launch_ranks(forward(study), load_study_config(study).launch, module=module)
            if code:
                sys.exit(code)
    except PlannerError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def as_tune_ranks() -> None:
    """Import what a ``tune`` rank has imported before it records (``jobs.tune``), so that a bench records in the
    process state ``tune`` records in ([Note: Record in tune's process state] in ``jobs/profile.py``, which does the
    same). Call it on every rank, first.

    Why: on a CPU these imports move how much an async all-gather hides in a step (the recorder's async default
    over its default reads lower after them). A bench that imported them only after recording
    solved the overlap slowdown from a ratio ``tune`` would not have read.
    """
    import jobs.tune  # noqa: F401


def json_flag(path: str | None) -> list[str]:
    """The ``--json PATH`` arguments to forward to the ranks (none without a path)."""
    return ["--json", path] if path else []


def user_profiler(device_type: str, folder: str, schedule: Any) -> Any:
    """``torch.profiler.profile`` as a user traces a plain loop and the benches trace it: the CPU activity (and
    CUDA's on a CUDA device), ``profile_memory``, ``record_shapes``, ``schedule``, one Kineto JSON per rank and cycle
    written into ``folder`` by ``tensorboard_trace_handler`` (``rank{R}`` in its name). Call it on every rank."""
    import torch
    import torch.distributed as dist

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device_type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    handler = torch.profiler.tensorboard_trace_handler(folder, worker_name=f"rank{dist.get_rank()}")
    return torch.profiler.profile(activities=activities, profile_memory=True, record_shapes=True,
                                  on_trace_ready=handler, schedule=schedule)
