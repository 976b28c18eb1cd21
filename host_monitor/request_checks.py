"""What the actuator's requests must hold before they change anything: a bad field is an
InvalidRequest (422), a request that does not fit the workers a WorkerConflict (409)."""

from __future__ import annotations

from pydantic import TypeAdapter, ValidationError

from host_monitor.errors import HostMonitorError
from host_monitor.wire import Name
from host_monitor.workers import Worker, WorkerConflict
from resiliency_protocol.node_commands import StartWorkersRequest

_NAME = TypeAdapter(Name)


class InvalidRequest(HostMonitorError):
    """A request that names a bad field (HTTP 422): `field` and a one-line message."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def check_env(env: dict[str, str]) -> None:
    for key, value in env.items():
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise InvalidRequest(f"env.{key}", "not a valid environment variable")


def check_start(req: StartWorkersRequest, job: str | None, live: list[Worker]) -> None:
    """`req` may start on a node serving `job` whose `live` workers run."""
    try:
        _NAME.validate_python(req.job)
    except ValidationError:
        raise InvalidRequest(
            "job", "must be 1-253 letters, digits, '-', '_' or '.', starting alphanumeric"
        ) from None
    check_env(req.env)
    ranks = [s.rank for s in req.workers]
    if len(ranks) != len(set(ranks)):
        raise InvalidRequest("workers", "ranks must be unique")
    if live and req.job != job:
        raise WorkerConflict(f"workers of job {job!r} are still running: stop them first")
    busy = sorted(w.rank for w in live if w.rank in set(ranks))
    if busy:
        raise WorkerConflict(f"ranks {busy} are still running: stop them first")
