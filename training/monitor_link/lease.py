"""The worker's lease on its rank: a rank cut off from the supervisor stops itself.

After a hot-swap, the rank a node ran is run by its replacement; the old process, on a
node whose host monitor is frozen or cut off by the network, cannot be told to stop. So a
rank holds its rank only while its host monitor says the supervisor heard it recently:
each answer to a progress report (`ProgressReply.supervisor_heard_s`) renews the lease up
to `host_lease_s` after the supervisor last answered that host monitor's heartbeats. A
host monitor that does not answer (frozen) renews nothing; one cut off answers with a
growing age. Once the lease has run out:

- the checkpoint savers refuse every durable write (`check`, raising `HostLeaseExpired`:
  training/checkpoint/saver.py, the NumPy workload's), reported as a failed save;
- the process ends with exit status `LEASE_EXIT_CODE` one report interval later, whatever
  its main thread is doing (it may sit in a collective, where no exception would reach
  it): an unmodified script's rank ends so, and its log says why. Nothing is raised into
  the training loop: the exit status is what tells this end from a crash.

The lease is armed by the first answer that names an age: a host monitor without a
supervisor (or one too old to say) never stops its workers. `host_lease_s` 0 turns it off.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from resiliency_protocol import worker_env
from resiliency_protocol.shared_settings import DEFAULT_HOST_LEASE_S
from training.errors import TrainingError
from training.monitor_link.connection import log

#: The exit status of a rank whose lease ran out (EX_TEMPFAIL: run it again elsewhere).
LEASE_EXIT_CODE = 75


class HostLeaseExpired(TrainingError, RuntimeError):
    """The rank's host monitor has not vouched for the supervisor's contact within
    `host_lease_s`: another process may hold this rank now."""


@dataclass(frozen=True)
class LeaseSettings:
    #: Seconds a rank keeps training after the supervisor last answered its host monitor
    #: (three of the host monitor's default heartbeat periods); 0: no lease.
    host_lease_s: float = DEFAULT_HOST_LEASE_S

    def __post_init__(self) -> None:
        if not (self.host_lease_s >= 0 and self.host_lease_s < float("inf")):
            raise ValueError(f"host_lease_s must be >= 0 seconds, got {self.host_lease_s!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LeaseSettings:
        """`HOST_LEASE_S` (seconds), else the default."""
        env = os.environ if env is None else env
        text = env.get(worker_env.HOST_LEASE_S, "").strip()
        if not text:
            return cls()
        try:
            value = float(text)
        except ValueError:
            name = worker_env.HOST_LEASE_S
            raise ValueError(f"{name}: not a number of seconds: {text!r}") from None
        return cls(host_lease_s=value)


class HostLease:
    def __init__(
        self,
        settings: LeaseSettings,
        rank: int,
        grace_s: float,
        exit_process: Callable[[int], None] = os._exit,
    ) -> None:
        self.settings = settings
        self._rank = rank
        self._grace_s = grace_s
        self._exit = exit_process
        self._until: float | None = None  # monotonic; None: not armed
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def expired(self) -> bool:
        until = self._until
        return until is not None and time.monotonic() >= until

    def renew(self, asked_at: float, heard_s: float | None) -> None:
        """The host monitor answered a report sent at `asked_at` (monotonic): the
        supervisor had answered it `heard_s` seconds before (None: not said)."""
        lease_s = self.settings.host_lease_s
        if heard_s is None or lease_s <= 0 or self._closed:
            return
        until = asked_at - heard_s + lease_s
        with self._lock:
            if self._until is not None and until <= self._until:
                return
            if self._until is not None and time.monotonic() >= self._until:
                return  # run out: not taken back (the rank has been told to stop)
            self._until = until
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name=f"worker-lease-{self._rank}", daemon=True
                )
                self._thread.start()
        self._changed.set()

    def check(self, what: str) -> None:
        """HostLeaseExpired when the lease ran out: `what` (a durable write) is refused."""
        if self.expired:
            raise HostLeaseExpired(
                f"rank {self._rank}: {what} refused: its host monitor has not vouched for "
                f"the supervisor's contact within host_lease_s={self.settings.host_lease_s:g}"
                " s; another process may hold this rank now"
            )

    def close(self) -> None:
        self._closed = True
        self._changed.set()

    def _watch(self) -> None:
        while not self._closed:
            until = self._until
            assert until is not None
            left = until - time.monotonic()
            if left > 0:
                self._changed.clear()
                self._changed.wait(left)
                continue
            log.error(
                "worker client: rank %d's lease ran out (host_lease_s=%g s without word of "
                "the supervisor from its host monitor): it stops training and exits with "
                "status %d in %g s; durable writes are refused",
                self._rank,
                self.settings.host_lease_s,
                LEASE_EXIT_CODE,
                self._grace_s,
            )
            time.sleep(self._grace_s)
            if not self._closed:
                self._exit(LEASE_EXIT_CODE)
            return
