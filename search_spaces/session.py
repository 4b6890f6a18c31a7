"""The tuning session over a study's search space: where the planner's session, Optuna and the search spaces are put
together, once, for both entry points: ``prefetch-planner tune`` (``jobs.tune``) and the in-loop tuner
(``runtime.in_loop.round``).

The planner never imports the search spaces (it is handed one, ``planner.study.SearchSpace``), and the two entry
points import both: this module is the one place that hands the study's configured space to a
:class:`~planner.study.session.TuningSession` and sets how loud Optuna is while it runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from search_spaces import get_space

if TYPE_CHECKING:
    from planner.artifacts.config import StudyConfig
    from planner.artifacts.profile import Profile
    from planner.study.session import TuningSession


def open_session(config: StudyConfig, profile: Profile, *, job: str | None = None, **options: Any) -> TuningSession:
    """A tuning session of ``config``'s study over its ``[search] space``, on ``profile``.

    Args:
        config: the study.
        profile: the profile the simulated stage searches with.
        job: the job's name (default: a new one, ``planner.study.measured.job_name``; every rank must agree).
        options: the session's other keyword arguments (``plan_out``, ``profile_out``, ``confirm_launches``,
            ``source``, ...: ``TuningSession``).

    Raises:
        StudyConfigError: the study names no known search space.
    """
    from planner.study.measured import job_name
    from planner.study.session import TuningSession

    return TuningSession(config, profile, get_space(config.search.space), job=job or job_name(), **options)


@contextlib.contextmanager
def optuna_quiet() -> Iterator[None]:
    """Optuna's log at WARNING inside the block (no line per simulated trial), as it was after it."""
    import optuna

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(verbosity)
