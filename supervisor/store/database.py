"""Engine creation and schema migration (Alembic, run at start-up)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import InterfaceError, OperationalError

MIGRATIONS = Path(__file__).with_name("migrations")

#: What the driver raises while the database cannot be reached or written (its server
#: down or restarting, the connection lost, the disk full): nothing was written, and the
#: same write may be tried again later.
UNAVAILABLE: tuple[type[Exception], ...] = (OperationalError, InterfaceError)


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine whose commits are durable once they return."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        # The driver we ship is psycopg 3; plain postgresql:// would ask for psycopg2.
        parsed = parsed.set(drivername="postgresql+psycopg")
        url = parsed.render_as_string(hide_password=False)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database
        if database and database != ":memory:":
            Path(database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 30}, **kwargs
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cursor = dbapi_conn.cursor()
            # WAL lets readers run beside the writer; FULL syncs the WAL on every commit,
            # so an acknowledged event survives even a power cut, not only a crash.
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=FULL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=5, **kwargs)


def alembic_config(engine: Engine) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    # ConfigParser treats % as interpolation: escape it (encoded passwords, options=...).
    url = engine.url.render_as_string(hide_password=False).replace("%", "%%")
    config.set_main_option("sqlalchemy.url", url)
    config.attributes["engine"] = engine
    return config


def migrate(engine: Engine, revision: str = "head") -> None:
    """Bring the schema up to `revision`; safe to run on every start."""
    command.upgrade(alembic_config(engine), revision)
