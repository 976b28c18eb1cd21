"""The worlds of an in-process restart: waiting for the host monitor to hand this worker
a new world, and telling it once the worker trains in it."""

from __future__ import annotations

import re
import time

import httpx

from resiliency_protocol.worker_wire import ATTEMPT_PATTERN, WorldAssignment, worker_path
from training.monitor_link.connection import MonitorConnection, log
from training.monitor_link.reporter import Reporter

ATTEMPT_RE = re.compile(ATTEMPT_PATTERN)


class Worlds:
    """The world this worker trains in is `Reporter.attempt` (sent with its progress)."""

    def __init__(self, connection: MonitorConnection, reporter: Reporter, rank: int) -> None:
        self._connection = connection
        self._reporter = reporter
        self._rank = rank

    def new_world(
        self, timeout_s: float, poll_s: float, first: bool
    ) -> tuple[str, dict[str, str]] | None:
        """Poll GET /v1/workers/{rank}/world until it names a world to join (see
        `WorkerClient.new_world`); None after `timeout_s` or offline."""
        http = self._connection.http
        if http is None:
            return None
        deadline = time.monotonic() + timeout_s
        path = worker_path(self._rank, "world")
        while True:
            try:
                response = http.get(path)
                response.raise_for_status()
                world: WorldAssignment | None = WorldAssignment.model_validate_json(
                    response.content
                )
            except (httpx.HTTPError, ValueError) as exc:  # ValidationError is a ValueError
                world = None
                if self._connection.first_failure("world"):
                    log.warning("worker client: asking for a new world failed: %s", exc)
            if world is not None:
                self._connection.works("world")
                current = self._reporter.attempt
                if world.attempt is not None and (first or world.attempt != current):
                    return world.attempt, dict(world.env)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(poll_s, left))

    def joined(self, attempt: str) -> None:
        """Train in world `attempt` from now on, and tell the host monitor at once."""
        if not ATTEMPT_RE.match(attempt):
            raise ValueError(f"attempt must match {ATTEMPT_RE.pattern}, got {attempt!r}")
        self._reporter.attempt = attempt
        self._reporter.report_now()
