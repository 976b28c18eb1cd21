"""Registering a worker with its host monitor, and again when the monitor forgot it."""

from __future__ import annotations

import time
from typing import Any

from resiliency_protocol.backoff import attempt_delay
from resiliency_protocol.worker_wire import REGISTER_PATH, WorkerRegistration
from training.monitor_link.connection import MonitorConnection, log
from training.process_identity import self_identity

# A host monitor that answers a progress report with 404 does not know this worker (it
# restarted, e.g. a DaemonSet rollout, or was not up at `register()`): register again,
# at most this often.
_REREGISTER_EVERY_S = 2.0


class Registration:
    """What the host monitor was told of this process, and whether it took it."""

    def __init__(
        self,
        connection: MonitorConnection,
        rank: int,
        local_rank: int,
        job: str | None,
        instance: str | None,
    ) -> None:
        self._connection = connection
        self._rank = rank
        self._local_rank = local_rank
        self._job = job
        self._instance = instance
        #: pid and pid_namespace, once the host monitor took the registration.
        self.registered: dict[str, Any] | None = None
        self._body: dict[str, Any] | None = None
        self._next_register = 0.0  # monotonic

    def register(self, world_size: int | None, attempts: int, retry_delay_s: float) -> bool:
        """POST the registration, retried briefly; True if the host monitor took it."""
        me = self_identity()
        # What is unknown is left out (not sent as null): what older host monitors take.
        known = {
            "job": self._job,
            "instance": self._instance,
            "pid_namespace": me.pid_namespace,
            "start_time": me.start_time,
            "world_size": world_size,
        }
        body = self._connection.body(
            WorkerRegistration,
            "register",
            rank=self._rank,
            local_rank=self._local_rank,
            pid=me.pid,
            **{k: v for k, v in known.items() if v is not None},
        )
        self._body = body
        for attempt in range(max(1, attempts)):
            if body is None:
                break  # the host monitor would refuse it (logged): asking again changes nothing
            if self._connection.post(REGISTER_PATH, body, kind="register") is not None:
                self.registered = {"pid": me.pid, "pid_namespace": me.pid_namespace}
                return True
            if attempt + 1 < attempts:
                time.sleep(attempt_delay(retry_delay_s, attempt + 1))
        return False

    def renew_if_forgotten(self, now: float) -> None:
        """Register again when a progress report found the host monitor does not know
        this worker (at most every `_REREGISTER_EVERY_S`)."""
        body = self._body
        if not self._connection.unknown_to_monitor or body is None or now < self._next_register:
            return
        self._next_register = now + _REREGISTER_EVERY_S
        if self._connection.post(REGISTER_PATH, body, kind="register") is not None:
            self._connection.unknown_to_monitor = False
            self.registered = {"pid": body["pid"], "pid_namespace": body.get("pid_namespace")}
            log.info("worker client: registered with the host monitor again")
