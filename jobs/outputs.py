"""The files a job writes: checked before any rank starts."""

from __future__ import annotations

from pathlib import Path

from planner.errors import PlannerError


def check_output_folders(*outputs: str | None) -> None:
    """Each output file's folder must exist (nothing is created; ``None`` entries are skipped).

    Raises:
        PlannerError: naming the first output whose folder is missing.
    """
    for out in filter(None, outputs):
        if not Path(out).parent.is_dir():
            raise PlannerError(f"cannot write {out!r}: folder {str(Path(out).parent)!r} does not exist")
