"""What a command shares with the ranks it launches: the validated study handed over, the ranks' exit codes,
one line for a rank's error, and rank 0's progress on stdout.

Importing this module does not import torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from jobs import PROGRESS_LOGGERS
from planner.artifacts.config import StudyConfig, load_study_config


def study_config(study_toml: str, validated_config: str | None, **overrides: Any) -> StudyConfig:
    """The study: the validated config the launching process handed over (:func:`handed_over`), else the TOML
    with the command line's ``overrides``, validated here (a rank started by the user's own torchrun)."""
    if validated_config is not None:
        return StudyConfig.from_validated_json(Path(validated_config).read_text())
    return load_study_config(study_toml, **overrides)


@contextlib.contextmanager
def handed_over(config: StudyConfig) -> Iterator[list[str]]:
    """The validated ``config`` written once for the ranks this process launches; yields the arguments that hand
    it over (``--validated-config FILE``), so every rank reads the one object, not the TOML and rebuilt options."""
    with tempfile.TemporaryDirectory(prefix="prefetch-planner-") as folder:
        path = Path(folder) / "study.json"
        path.write_text(config.to_validated_json())
        yield ["--validated-config", str(path)]


def log_rank0_progress() -> None:
    """Rank 0 prints the jobs' and libraries' progress records (INFO) to stdout; other ranks only warnings."""
    rank0 = os.environ.get("RANK", "0") == "0"
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    for name in PROGRESS_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.setLevel(logging.INFO if rank0 else logging.WARNING)
        logger.propagate = False


def exit_with_ranks(code: int, what: str, expected: tuple[int, ...]) -> None:
    """Exit with the ranks' code; for an unexpected one (a crash), say so in one line.

    Interrupted (130): the ranks are gone and rank 0 said what it recorded, so the launcher leaves at once
    (``os._exit``), without the interpreter's teardown. Once in about ten CI runs the launcher aborted after
    everything was done ("terminate called without an active exception", exit -6, in
    ``tests/runtime/ranks/test_cluster.py::test_ctrl_c_fails_the_running_trials_cleanly``). The suspect is that
    teardown: after a signal torchrun leaves its rendezvous and store open (``launch_agent``), for the
    interpreter to destroy. Not reproduced in 60 interrupted launches here, so not proven.
    """
    if not code:
        return
    if code not in expected:
        click.echo(f"error: a {what} rank failed with exit code {code}; see its output above", err=True)
    if code == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    sys.exit(code if code in expected else 1)


def exit_on_rank_error(e: BaseException) -> None:
    """Exit on a rank's error; rank 0 prints the one line.

    Bad input (a factory that raises, a model without ``fully_shard``) fails
    alike on every rank, and a :class:`planner.TrialFailedError` carries the
    same message on every rank, so one line is enough. Exit codes: the
    error's ``exit_code`` (2 bad input, 3 a failed trial), 130 interrupted.
    """
    if isinstance(e, KeyboardInterrupt):
        message = (f"interrupted ({e or 'SIGINT'}); the measured trials that were running are recorded as FAIL; "
                   "run `prefetch-planner tune` again to resume the study")
        code = 130
    else:
        message, code = str(e), getattr(e, "exit_code", 2)
    rank = os.environ.get("RANK", "0")
    if rank == "0":
        print(f"error: {message}", file=sys.stderr, flush=True)
    elif getattr(e, "local", False):  # e.g. rank 0 died: nobody else would say it
        print(f"error: rank {rank}: {message}", file=sys.stderr, flush=True)
    sys.exit(code)
