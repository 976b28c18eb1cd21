"""PostgreSQL servers of the tests' own, from this machine's PostgreSQL binaries (Debian's
`postgresql`, which `make test` installs when missing): initdb in a temporary directory,
started on a free port of the loopback, stopped afterwards. Nothing is assumed running."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.local.ports import free_port

MISSING = "no PostgreSQL binaries under /usr/lib/postgresql (make test installs Debian's)"


def binaries() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(found[-1]).parent if found else None


class PrivatePostgres:
    """A PostgreSQL server of our own: initdb, start, stop like a crash, start again."""

    def __init__(self, root: Path) -> None:
        bin_dir = binaries()
        if bin_dir is None:
            pytest.skip(MISSING)
        self.bin = bin_dir
        self.data = root / "pgdata"
        self.port = free_port()
        self.log = root / "postgres.log"
        # initdb and the server refuse to run as root: as the `postgres` user then.
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(root, "postgres")
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run(
            [*self.as_user, str(self.bin / tool), *args],
            check=True,
            capture_output=True,
            timeout=120,
        )

    def start(self) -> None:
        # fsync off: a test server's data need not survive the machine.
        options = (
            f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c max_connections=300"
        )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "start")

    def crash(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "stop")

    def stop(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "stop")


@contextlib.contextmanager
def running_postgres() -> Iterator[PrivatePostgres]:
    """A started server, stopped and removed on exit."""
    # Not under pytest's temporary directory: it is private to root, and the server runs
    # as `postgres`.
    root = Path(tempfile.mkdtemp(prefix="supervisor-pg-"))
    try:
        server = PrivatePostgres(root)
        server.start()
        try:
            yield server
        finally:
            server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
