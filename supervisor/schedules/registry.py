"""Which running supervisor a stored job belongs to.

APScheduler stores a job as a reference to a module-level function and its arguments,
so a job cannot hold the supervisor object. It holds a key instead: the supervisor's
database (its URL without the password, so that rotating the password keeps the jobs
working), under which the acting supervisor registers itself while it runs. A job
whose supervisor is not registered (it is stopping) does nothing; the next acting
supervisor runs the job's next turn.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import make_url

_hosts: dict[str, Any] = {}


def host_key(database_url: str) -> str:
    """The key of the supervisor acting on this database."""
    url = make_url(database_url).set(password=None)
    return url.render_as_string(hide_password=False)


def register(key: str, host: Any) -> None:
    _hosts[key] = host


def unregister(key: str, host: Any) -> None:
    if _hosts.get(key) is host:
        del _hosts[key]


def lookup(key: str) -> Any | None:
    return _hosts.get(key)
