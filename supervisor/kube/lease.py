"""One replica's side of the Lease: acquire it, renew it, check it may still act, give
it up. The algorithm, the clocks it trusts and the fencing it allows are described in
leader.py, which runs the supervisor on it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from supervisor.kube.errors import ApiError, Conflict, KubeError, NotFound, api_error

log = logging.getLogger(__name__)

#: client-go's JitterFactor for candidates: spreads the replicas' attempts.
JITTER = 0.2

Obj = dict[str, Any]
T = TypeVar("T")


class LeadershipLost(KubeError):
    """This replica no longer holds the Lease; the message says why."""


class ElectionSettings(Protocol):
    """The high availability settings, and the namespace of the Lease (Kubernetes)."""

    @property
    def leader_election_lease_name(self) -> str: ...
    @property
    def kube_namespace(self) -> str: ...
    @property
    def leader_election_identity(self) -> str | None: ...
    @property
    def leader_election_lease_duration_s(self) -> float: ...
    @property
    def leader_election_renew_deadline_s(self) -> float: ...
    @property
    def leader_election_retry_period_s(self) -> float: ...


@dataclass(frozen=True, slots=True)
class ElectionConfig:
    lease_name: str
    namespace: str
    identity: str
    lease_duration_s: float
    renew_deadline_s: float
    retry_period_s: float

    @classmethod
    def from_settings(cls, settings: ElectionSettings) -> ElectionConfig:
        return cls(
            lease_name=settings.leader_election_lease_name,
            namespace=settings.kube_namespace,
            identity=settings.leader_election_identity or socket.gethostname(),
            lease_duration_s=settings.leader_election_lease_duration_s,
            renew_deadline_s=settings.leader_election_renew_deadline_s,
            retry_period_s=settings.leader_election_retry_period_s,
        )


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """The Lease's spec: who holds it, since when, and for how long without renewal."""

    holder: str
    lease_duration_s: int
    acquire_time: str | None
    renew_time: str | None
    transitions: int

    @classmethod
    def of(cls, lease: Obj) -> LeaseRecord:
        spec = lease.get("spec") or {}
        return cls(
            holder=spec.get("holderIdentity") or "",
            lease_duration_s=int(spec.get("leaseDurationSeconds") or 0),
            acquire_time=spec.get("acquireTime"),
            renew_time=spec.get("renewTime"),
            transitions=int(spec.get("leaseTransitions") or 0),
        )

    def spec(self) -> Obj:
        return {
            "holderIdentity": self.holder or None,
            "leaseDurationSeconds": self.lease_duration_s,
            "acquireTime": self.acquire_time,
            "renewTime": self.renew_time,
            "leaseTransitions": self.transitions,
        }


def micro_time(now: datetime | None = None) -> str:
    """metav1.MicroTime: RFC 3339 with 6 fractional digits, UTC.

    Client 37 validates request bodies into its models and writes times back with
    `datetime.isoformat()`, which drops the fraction when it is zero; the server parses
    MicroTime with a fixed `.000000` layout and would refuse that. So never zero.
    """
    now = now or datetime.now(UTC)
    if now.microsecond == 0:
        now = now.replace(microsecond=1)
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """Acquires, renews and releases one Lease for one identity."""

    def __init__(
        self,
        api: client.CoordinationV1Api,
        config: ElectionConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        # Dicts in, JSON out; the client's type stubs only know its models.
        self._raw: Any = api
        self.config = config
        self._clock = clock
        self._observed: LeaseRecord | None = None
        self._observed_at = 0.0
        #: Start of the last successful write as holder; None while not leading.
        self._renewed_at: float | None = None
        self._last_error: str | None = None
        # The Lease holds whole seconds; rounding up never shortens what others wait.
        self._duration = max(1, math.ceil(config.lease_duration_s))

    @property
    def identity(self) -> str:
        return self.config.identity

    @property
    def is_leader(self) -> bool:
        return self._renewed_at is not None

    @property
    def leader(self) -> str | None:
        """The holder we last saw, while its Lease is valid; None when nobody leads."""
        if self.is_leader:
            return self.identity
        record = self._observed
        if record is None or not record.holder or self._expired(record):
            return None
        return record.holder

    def check(self) -> None:
        """Raise LeadershipLost unless this replica may act now: it leads, and its last
        renewal started less than `renew_deadline` ago, so no other replica can have
        taken the Lease. `hold` would notice the same, later: a replica frozen (SIGSTOP,
        a paused VM, a long GC) for longer than the Lease lasts wakes up with other
        tasks ready to run before it."""
        if self._renewed_at is None:
            raise LeadershipLost("this replica does not hold the Lease")
        age = self._clock() - self._renewed_at
        if age >= self.config.renew_deadline_s:
            raise LeadershipLost(
                f"the last renewal of the Lease started {age:.1f} s ago, past the renew"
                f" deadline ({self.config.renew_deadline_s:g} s): was this replica frozen?"
            )

    def _expired(self, record: LeaseRecord) -> bool:
        duration = record.lease_duration_s or self._duration
        return self._clock() >= self._observed_at + duration

    def _observe(self, record: LeaseRecord) -> None:
        if record != self._observed:
            self._observed = record
            self._observed_at = self._clock()

    # --- one round ----------------------------------------------------------------------

    async def try_acquire_or_renew(self) -> bool:
        """One attempt. True: we hold the Lease now. False: someone else does, or the API
        failed (logged). Raises LeadershipLost when we led and the Lease was taken or
        deleted."""
        started = self._clock()
        try:
            return await self._try(started)
        except LeadershipLost:
            self._renewed_at = None
            raise
        except ApiError as exc:
            self._api_error(f"{exc.status} {exc.reason}")
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            self._api_error(f"{type(exc).__name__}: {exc}")
        return False

    async def _try(self, started: float) -> bool:
        now = micro_time()
        lease = await self._read()
        if lease is None:
            if self.is_leader:
                raise LeadershipLost(f"Lease {self._where()} was deleted")
            record = LeaseRecord(self.identity, self._duration, now, now, 0)
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.config.lease_name, "namespace": self.config.namespace},
                "spec": record.spec(),
            }
            if not await self._write(body, create=True):
                return False
            return self._won(record, started)
        old = LeaseRecord.of(lease)
        self._observe(old)
        if self.is_leader and old.holder != self.identity:
            who = repr(old.holder) if old.holder else "nobody"
            raise LeadershipLost(f"Lease {self._where()} is now held by {who}")
        if old.holder and old.holder != self.identity and not self._expired(old):
            return False
        if old.holder == self.identity:
            # Ours (renewal, or this identity's previous process): same term.
            record = LeaseRecord(
                self.identity, self._duration, old.acquire_time or now, now, old.transitions
            )
        else:
            record = LeaseRecord(self.identity, self._duration, now, now, old.transitions + 1)
        body = {**lease, "spec": {**(lease.get("spec") or {}), **record.spec()}}
        if not await self._write(body, create=False):
            return False
        return self._won(record, started)

    def _won(self, record: LeaseRecord, started: float) -> bool:
        if not self.is_leader:
            log.info(
                "acquired Lease %s as %r (transitions: %d)",
                self._where(),
                self.identity,
                record.transitions,
            )
        self._observe(record)
        self._renewed_at = started
        if self._last_error is not None:
            log.info("Lease %s: the API answers again", self._where())
            self._last_error = None
        return True

    def _api_error(self, what: str) -> None:
        # One line per new problem, not one per retry period.
        level = logging.WARNING if what != self._last_error else logging.DEBUG
        log.log(level, "Lease %s: API error (%s); will retry", self._where(), what)
        self._last_error = what

    def _where(self) -> str:
        return f"{self.config.namespace}/{self.config.lease_name}"

    # --- API calls (the client is blocking: run in threads, bounded by a timeout) --------

    async def _read(self) -> Obj | None:
        def read() -> Obj:
            response = self._raw.read_namespaced_lease(
                self.config.lease_name,
                self.config.namespace,
                _preload_content=False,
                _request_timeout=self.config.renew_deadline_s,
            )
            lease: Obj = json.loads(response.data)
            return lease

        try:
            return await self._call(f"get lease {self._where()}", read)
        except NotFound:
            return None

    async def _write(self, body: Obj, *, create: bool) -> bool:
        """Create or replace (with the resourceVersion read); False on 409 Conflict."""

        def write() -> None:
            options: Obj = {
                "_preload_content": False,
                "_request_timeout": self.config.renew_deadline_s,
            }
            if create:
                self._raw.create_namespaced_lease(self.config.namespace, body, **options)
            else:
                self._raw.replace_namespaced_lease(
                    self.config.lease_name, self.config.namespace, body, **options
                )

        try:
            await self._call(f"{'create' if create else 'replace'} lease {self._where()}", write)
        except Conflict:  # another replica wrote first (or created it)
            return False
        return True

    @staticmethod
    async def _call(what: str, func: Callable[[], T]) -> T:
        try:
            return await asyncio.to_thread(func)
        except ApiException as exc:
            raise api_error(exc, what) from None

    # --- loops --------------------------------------------------------------------------

    async def acquire(self, on_attempt: Callable[[], None] | None = None) -> None:
        """Return once this replica holds the Lease (tries every retry period, jittered)."""
        while not await self.try_acquire_or_renew():
            if on_attempt is not None:
                on_attempt()
            period = self.config.retry_period_s
            await asyncio.sleep(period * (1 + JITTER * random.random()))

    async def hold(self) -> None:
        """Renew until the Lease is lost; then raise LeadershipLost. Never returns."""
        if self._renewed_at is None:
            raise LeadershipLost("not the leader")
        deadline_s = self.config.renew_deadline_s
        while True:
            deadline = self._renewed_at + deadline_s
            await asyncio.sleep(min(self.config.retry_period_s, max(0.0, deadline - self._clock())))
            remaining = deadline - self._clock()
            if remaining <= 0:
                self._renewed_at = None
                raise LeadershipLost(f"could not renew the Lease within {deadline_s:g} s")
            try:
                async with asyncio.timeout(remaining):
                    await self.try_acquire_or_renew()
            except TimeoutError:
                self._renewed_at = None
                raise LeadershipLost(
                    f"could not renew the Lease within {deadline_s:g} s (API too slow)"
                ) from None

    async def release(self) -> None:
        """Give the Lease up (graceful shutdown), so a standby need not wait for it to
        expire. As client-go: no holder, a 1 s duration, transitions kept."""
        if not self.is_leader:
            return
        self._renewed_at = None
        try:
            lease = await self._read()
            if lease is None or LeaseRecord.of(lease).holder != self.identity:
                return
            old = LeaseRecord.of(lease)
            now = micro_time()
            record = LeaseRecord("", 1, now, now, old.transitions)
            body = {**lease, "spec": {**(lease.get("spec") or {}), **record.spec()}}
            if await self._write(body, create=False):
                log.info("released Lease %s", self._where())
        except (ApiError, urllib3.exceptions.HTTPError, OSError) as exc:
            log.warning("could not release Lease %s (%s); it will expire", self._where(), exc)
