"""Shared pytest fixtures; the helpers behind them live in :mod:`planner.testing`."""

from __future__ import annotations

import pytest

from planner.testing import synthetic_profile
from tests.multirank import run_cli, run_ranks


@pytest.fixture
def make_profile():
    return synthetic_profile


@pytest.fixture
def ranks():
    """:func:`tests.multirank.run_ranks`: a script of ``tests/runtime/rank_scripts`` on gloo ranks."""
    return run_ranks


@pytest.fixture
def cli():
    """:func:`tests.multirank.run_cli`: ``prefetch-planner`` in a subprocess."""
    return run_cli


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server on loopback (``tests/postgres.py``); yields a factory of fresh database URLs.

    Skipped where no server binaries are installed, except under CI
    (``CI`` set), where ``.ci/run`` installs them and a skip would hide a gap.
    """
    from tests.postgres import server_or_skip

    server = server_or_skip()
    server.start()
    counter = iter(range(1_000_000))
    yield lambda: server.create_database(f"planner_{next(counter)}")
    server.stop()


@pytest.fixture
def two_nodes(request):
    """An emulated two-node cluster (:class:`bench.cluster.Cluster`) at the link rate ``request.param`` (default
    unshaped), torn down after the test.

    Skipped, with the one-line reason, where the machine cannot build one (no root, no iproute2), except under CI
    (``CI`` set), where ``.ci/run`` installs iproute2 and a skip would hide a gap.
    """
    import os

    from bench.cluster import Cluster, unavailable

    reason = unavailable()
    if reason:
        if os.environ.get("CI"):
            raise AssertionError(reason)
        pytest.skip(reason)
    with Cluster(getattr(request, "param", "none")) as cluster:
        yield cluster
