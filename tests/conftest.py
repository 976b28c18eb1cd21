"""Shared fixtures: databases (SQLite always, PostgreSQL when configured) and settings."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from supervisor.config import Settings

PG_URL = os.environ.get("SUPERVISOR_TEST_DATABASE_URL")
AGENT_TOKEN = "agent-token-for-tests"
OPERATOR_TOKEN = "operator-token-for-tests"


def _pg_engine_url(url: str) -> str:
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A PostgreSQL URL whose search_path is a fresh schema, dropped afterwards.

    A schema per test keeps concurrent runs on one database out of each other's way.
    """
    if not PG_URL:
        pytest.skip("SUPERVISOR_TEST_DATABASE_URL is not set")
    base = _pg_engine_url(PG_URL)
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    """Each test using this runs on SQLite and, when configured, on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/supervisor.db"
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture
def sqlite_url(tmp_path: Any) -> str:
    return f"sqlite:///{tmp_path}/supervisor.db"


SettingsFactory = Callable[..., Settings]


@pytest.fixture
def make_settings(sqlite_url: str) -> SettingsFactory:
    """Settings for tests: known tokens, fault injection on, fast timeouts."""

    def build(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "database_url": sqlite_url,
            "agent_token": AGENT_TOKEN,
            "operator_token": OPERATOR_TOKEN,
            "enable_fault_injection": True,
            "heartbeat_polling_period_s": 0.1,
            "heartbeat_timeout_s": 0.5,
            "action_retry_backoff_s": 0.01,
        }
        values.update(overrides)
        return Settings(**values)

    return build
