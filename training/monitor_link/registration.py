"""Registering a worker with its host monitor, and again when the monitor forgot it; and
whether it takes emergency checkpoints, which the host monitor must know before it ever
sends SIGUSR1 (the signal's default action ends the process)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from resiliency_protocol.backoff import attempt_delay
from resiliency_protocol.worker_wire import (
    REGISTER_PATH,
    WorkerEmergencyCheckpoints,
    WorkerRegistration,
    worker_path,
)
from training.monitor_link.connection import MonitorConnection, log
from training.process_identity import self_identity

# A host monitor that answers a progress report with 404 does not know this worker (it
# restarted, e.g. a DaemonSet rollout, or was not up at `register()`): register again,
# at most this often.
_REREGISTER_EVERY_S = 2.0


@dataclass(frozen=True)
class Registered:
    """The process the host monitor took the registration of: what the reports that
    must come from that process (stopping, finishing) name."""

    pid: int
    pid_namespace: int | None

    @classmethod
    def of(cls, body: WorkerRegistration) -> Registered:
        return cls(pid=body.pid, pid_namespace=body.pid_namespace)


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
        self.registered: Registered | None = None
        self._body: WorkerRegistration | None = None
        self._next_register = 0.0  # monotonic
        #: Whether a SIGUSR1 handler of the client is installed (`take_emergency_checkpoints`).
        self.emergency_checkpoints = False
        # The reporting thread registers again while the main thread may say it takes
        # emergency checkpoints: one at a time, so the host monitor is left with the newest.
        self._lock = threading.Lock()

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
            # Left out when False (the default), as older host monitors take the body.
            "emergency_checkpoints": self.emergency_checkpoints or None,
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
            with self._lock:
                if self._connection.post(REGISTER_PATH, body, kind="register") is not None:
                    self.registered = Registered(pid=me.pid, pid_namespace=me.pid_namespace)
                    return True
            if attempt + 1 < attempts:
                time.sleep(attempt_delay(retry_delay_s, attempt + 1))
        return False

    def renew_if_forgotten(self, now: float) -> None:
        """Register again when a progress report found the host monitor does not know
        this worker (at most every `_REREGISTER_EVERY_S`)."""
        if not self._connection.unknown_to_monitor or self._body is None:
            return
        if now < self._next_register:
            return
        self._next_register = now + _REREGISTER_EVERY_S
        with self._lock:
            body = self._body  # the newest: `take_emergency_checkpoints` may have replaced it
            if body is None:
                return
            if self._connection.post(REGISTER_PATH, body, kind="register") is not None:
                self._connection.unknown_to_monitor = False
                self.registered = Registered.of(body)
                log.info("worker client: registered with the host monitor again")

    def take_emergency_checkpoints(self, enabled: bool) -> None:
        """This process handles SIGUSR1 now (`enabled`), or no longer does: said in every
        registration from now on, and at once to a host monitor it is registered with."""
        if enabled == self.emergency_checkpoints:
            return
        self.emergency_checkpoints = enabled
        with self._lock:
            if self._body is not None:
                # A new body, not a change in place: the reporting thread may be sending it.
                self._body = _saying_emergency_checkpoints(self._body, enabled)
            registered = self.registered
            if registered is None:
                return  # the registration will say it
            update = self._connection.body(
                WorkerEmergencyCheckpoints,
                "emergency-checkpoints",
                emergency_checkpoints=enabled,
                pid=registered.pid,
                pid_namespace=registered.pid_namespace,
            )
            path = worker_path(self._rank, "emergency-checkpoints")
            for _ in range(2):
                if update is None:
                    break  # the host monitor would refuse it (logged)
                if self._connection.post(path, update, "emergency-checkpoints") is not None:
                    break


def _saying_emergency_checkpoints(body: WorkerRegistration, enabled: bool) -> WorkerRegistration:
    """`body` that says the process takes emergency checkpoints (`enabled`), or, left out
    (the default, False, as older host monitors take it), that it does not."""
    fields = body.model_dump(exclude_unset=True)
    fields.pop("emergency_checkpoints", None)
    if enabled:
        fields["emergency_checkpoints"] = True
    return WorkerRegistration.model_validate(fields)
