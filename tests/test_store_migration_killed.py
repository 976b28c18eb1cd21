"""A supervisor killed in the middle of its schema migration (SIGKILL, as when its leadership
is lost while it migrates) leaves the database as it found it, on SQLite as on
PostgreSQL: the next start migrates it whole. On SQLite each CREATE TABLE had been
committed alone, and every later start failed on a table that already existed. Two
processes migrating at once both end with the schema at its head."""

from __future__ import annotations

import signal
import subprocess
import sys

from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect

from supervisor.store import make_engine, migrate
from supervisor.store.database import alembic_config

#: Migrates the database at argv[1] and kills itself with SIGKILL right after its
#: argv[2]-th CREATE TABLE has run.
KILLED_MIGRATION = """
import os, signal, sys
from sqlalchemy import event
from supervisor.store.database import make_engine, migrate

engine = make_engine(sys.argv[1])
created = 0

@event.listens_for(engine, "after_cursor_execute")
def kill_after(conn, cursor, statement, *args):
    global created
    if statement.lstrip().upper().startswith("CREATE TABLE"):
        created += 1
        if created == int(sys.argv[2]):
            os.kill(os.getpid(), signal.SIGKILL)

migrate(engine)
"""


def assert_at_head(url: str) -> None:
    """The database's schema is at the newest migration."""
    engine = make_engine(url)
    try:
        head = ScriptDirectory.from_config(alembic_config(engine)).get_current_head()
        with engine.connect() as connection:
            assert MigrationContext.configure(connection).get_current_revision() == head
    finally:
        engine.dispose()


def test_a_migration_killed_midway_leaves_nothing_and_the_next_one_completes(
    database_url: str,
) -> None:
    url = database_url
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_MIGRATION, url, "3"], capture_output=True, timeout=120
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()

    engine = make_engine(url)
    try:
        assert inspect(engine).get_table_names() == []  # the killed one's tables rolled back
        migrate(engine)
        assert "faults" in inspect(engine).get_table_names()
    finally:
        engine.dispose()
    assert_at_head(url)


def test_two_processes_migrating_at_once_both_end_at_the_head(database_url: str) -> None:
    url = database_url
    script = "import sys; from supervisor.store import make_engine, migrate; "
    script += "migrate(make_engine(sys.argv[1]))"
    both = [
        subprocess.Popen([sys.executable, "-c", script, url], stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    for proc in both:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()
    assert_at_head(url)
