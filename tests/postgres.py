"""A throwaway PostgreSQL server on loopback for the shared-study tests.

Uses the system's PostgreSQL binaries (Debian's ``postgresql`` package;
``.ci/run`` installs it). The server runs from a temporary folder on a free
port, listens on 127.0.0.1 only, trusts local connections, and is stopped
when the test session ends. PostgreSQL refuses to run as root, so under root
it runs as the ``postgres`` user.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.ports import free_port

#: Starts tried, each on a fresh port, before a server that cannot bind its port is an error.
BIND_TRIES = 5


def find_bin(name: str) -> str | None:
    """``name`` (``initdb``, ``pg_ctl``) on PATH or in Debian's versioned folder."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


class PostgresServer:
    """Start with :meth:`start`, connect with :attr:`url`, end with :meth:`stop`."""

    def __init__(self) -> None:
        self.initdb, self.pg_ctl = find_bin("initdb"), find_bin("pg_ctl")
        if not (self.initdb and self.pg_ctl):
            raise FileNotFoundError("PostgreSQL server binaries (initdb, pg_ctl) not found; apt-get install postgresql")
        self.root = Path(tempfile.mkdtemp(prefix="planner-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.user = None
        if os.geteuid() == 0:
            self.user = "postgres"
            pw = pwd.getpwnam(self.user)
            os.chown(self.root, pw.pw_uid, pw.pw_gid)

    def _run(self, *cmd: str) -> None:
        prefix = ["runuser", "-u", self.user, "--"] if self.user else []
        subprocess.run([*prefix, *cmd], check=True, capture_output=True, text=True, timeout=120)

    def start(self) -> str:
        """Initialise the cluster and start the server; returns :attr:`url`.

        A port taken between the draw and the server's bind is drawn again, up
        to :data:`BIND_TRIES` starts.

        Raises:
            RuntimeError: the server did not start; the message ends with its log.
        """
        self._run(self.initdb, "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        log = self.root / "log"
        for _ in range(BIND_TRIES):
            opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c max_connections=200 -c fsync=off"
            log.unlink(missing_ok=True)
            try:
                self._run(self.pg_ctl, "-D", str(self.data), "-o", opts, "-l", str(log), "-w", "start")
                return self.url
            except subprocess.CalledProcessError as e:
                text = log.read_text(errors="replace") if log.exists() else e.stderr
                if "could not bind" not in text:
                    raise RuntimeError(f"PostgreSQL did not start on port {self.port}; its log:\n{text}") from e
                self.port = free_port()
        raise RuntimeError(f"PostgreSQL could not bind a port in {BIND_TRIES} starts; its log:\n{text}")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/postgres"

    def create_database(self, name: str) -> str:
        """A new empty database; returns its URL."""
        import sqlalchemy as sa

        engine = sa.create_engine(self.url, isolation_level="AUTOCOMMIT")
        with engine.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        engine.dispose()
        return self.url.rsplit("/", 1)[0] + f"/{name}"

    def stop(self) -> None:
        try:
            if (self.data / "postmaster.pid").exists():
                self._run(self.pg_ctl, "-D", str(self.data), "-m", "immediate", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def server_or_skip() -> PostgresServer:
    """A :class:`PostgresServer` not yet started, or a skip where this machine has no PostgreSQL.

    Under CI (``CI`` set) a missing server is an error instead: ``.ci/run``
    installs one, and a skip would hide a gap.
    """
    import importlib.util

    import pytest

    try:
        if importlib.util.find_spec("psycopg2") is None:
            raise ImportError("psycopg2 is not installed: pip install -e '.[test]'")
        return PostgresServer()
    except (ImportError, FileNotFoundError) as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"no PostgreSQL here: {e}")
