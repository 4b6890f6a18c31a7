"""Saved bench runs read by the offline benches (``bench.anchor_level``, ``bench.anchor_guard``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import click

T = TypeVar("T")


def read_saved(paths: Iterable[str], read: Callable[[str], T], kind: str, hint: str) -> list[T]:
    """Each path through ``read``, in order.

    Args:
        paths: the saved runs' files.
        read: reads one file; raises ``KeyError``, ``TypeError``, ``ValueError`` (json's decode error is one) or
            ``IndexError`` for a file that is not such a run.
        kind: what such a run is, for the error line (``"a saved `bench.fidelity --json` run"``).
        hint: what to pass instead, for the error line.

    Raises:
        SystemExit: code 2, after one line on stderr naming the file, the problem and ``hint``.
    """
    runs = []
    for path in paths:
        try:
            runs.append(read(path))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            click.echo(f"error: {path}: not {kind} ({type(e).__name__}: {e}); {hint}", err=True)
            raise SystemExit(2) from e
    return runs
