"""Heartbeats to the supervisor: the node's state, its workers and new GPU reports.

One task, one request in flight at a time (the supervisor sees our states in order),
on a keep-alive connection. It never blocks the rest of the agent: the local API and
the process monitor run in their own tasks and only `trigger()` a send.

- Every `period_s` with +-10% jitter, so a fleet started together does not beat in step.
- At once on `trigger()` (a worker changed state, a GPU report arrived).
- On failure, again after an exponential backoff with jitter, capped at the period: a
  supervisor that is down or restarting gets a growing gap, and is found again quickly.
- GPU reports stay queued until a heartbeat carrying them was accepted (2xx).
- With the host monitor's credential (host_monitor/credentials.py), read again from its
  file when it rotates and after a 401.
- Each worker's report carries its world (`world_of`); a refusal because some of them
  belong to an older world than their job's newest (409 `stale_world`) is handed to
  `on_stale_world`, which stops them (resiliency_protocol/worlds.py).
- Each accepted heartbeat's answer names the job's newest world (a header), as does a
  `stale_world` refusal: handed to `on_job_world`, the peer tier's fence between worlds.
- Through a relay (`relay_url`, host_monitor/relay.py) when one is set: the same request,
  answered as the supervisor answers it. When the relay does not answer, or answers that
  it could not reach the supervisor (502), the same heartbeat goes directly to the
  supervisor at once: a relay that is down costs a node no heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
import msgspec

from host_monitor.credentials import BearerCredential, CredentialError
from host_monitor.wire import GpuReport, HostHeartbeat, WorkerReport, check_heartbeat
from resiliency_protocol.backoff import attempt_delay
from resiliency_protocol.error_reading import error_message
from resiliency_protocol.heartbeat import HEARTBEAT_PATH, URGENT_HEADER
from resiliency_protocol.shared_settings import CLIENT_KEEP_ALIVE_S
from resiliency_protocol.states import NodeState
from resiliency_protocol.tls import client_context
from resiliency_protocol.worlds import (
    JOB_WORLD_HEADER,
    StaleWorld,
    job_world_of,
    parse_world,
    stale_world_of,
)

log = logging.getLogger(__name__)

JITTER = 0.1
#: A relay's answer when it could not get the supervisor's (host_monitor/relay.py).
RELAY_UPSTREAM_FAILED = 502
MAX_QUEUED_REPORTS = 256  # the supervisor's bound per heartbeat


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    state: NodeState
    job: str | None
    workers: list[WorkerReport]
    # Counts the node's changes: `on_delivered` tells the node which one the supervisor
    # has seen (it releases itself only once the workers' exits were delivered).
    version: int = 0


def world_of(attempt: str | None, joining: str | None, started: int | None) -> int | None:
    """A worker's world: the newest of the one it reported training in (`attempt`), the
    one it was told to join (an in-process restart, `joining`) and the one it was started
    in; None when none is known."""
    worlds = [w for w in (parse_world(attempt), parse_world(joining), started) if w is not None]
    return max(worlds, default=None)


class HeartbeatSender:
    def __init__(
        self,
        supervisor_url: str,
        credential: str | BearerCredential,
        node: str,
        period_s: float,
        snapshot: Callable[[], NodeSnapshot],
        address: str | None = None,
        on_delivered: Callable[[NodeSnapshot], None] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        mirrors: Sequence[str] = (),
        on_stale_world: Callable[[StaleWorld], None] | None = None,
        unreachable_peers: Callable[[], list[str]] | None = None,
        relay_url: str | None = None,
    ) -> None:
        """`ssl_context`: how an https:// supervisor is verified (default: the system's
        trust store). `mirrors`: base URLs of dry-run supervisors shadowing this one,
        each sent a copy of every heartbeat (see `HeartbeatMirror`). `on_stale_world`:
        told when the supervisor refuses workers of an older world. `unreachable_peers`:
        the peers this node's probes cannot reach (peer/probes.py). `relay_url`: a
        heartbeat relay's base URL, tried first."""
        self.url = supervisor_url.rstrip("/") + HEARTBEAT_PATH
        self.relay_url = None if relay_url is None else relay_url.rstrip("/") + HEARTBEAT_PATH
        self.relayed = 0  # heartbeats the relay answered for the supervisor (status, tests)
        self._ssl = ssl_context if ssl_context is not None else client_context()
        self._credential = BearerCredential.of(credential)
        self.node = node
        self.period_s = period_s
        self.address = address
        self._snapshot = snapshot
        self._on_delivered = on_delivered
        self._pending: list[GpuReport] = []
        self._wake = asyncio.Event()
        self._urgent = False  # the next heartbeat was asked for at once (`trigger`)
        self._silenced = False
        self.delivered = 0  # heartbeats accepted, for status, metrics and tests
        self.failed_total = 0  # heartbeats that did not get through (metrics)
        self.last_delivered_unix_s: float | None = None
        #: When the supervisor last answered (monotonic): any HTTP answer, or a refused
        #: connection (its host answered; a restart). What the workers' lease runs from.
        self.last_answered: float | None = None
        self._failures = 0
        self._last_problem: str | None = None
        self._relay_problem: str | None = None
        self.mirrors = [HeartbeatMirror(url, self._credential, self._ssl) for url in mirrors]
        self._on_stale_world = on_stale_world
        self.stale_worlds = 0  # refusals for an older world, for status and tests
        self._unreachable_peers = unreachable_peers
        #: Told `(job, world)`: the newest world the supervisor started for the job.
        self.on_job_world: Callable[[str, int], None] | None = None

    # --- used by the rest of the agent ----------------------------------------------------

    def trigger(self) -> None:
        """Send a heartbeat now (on the sender's task), without waiting for the period."""
        self._urgent = True
        self._wake.set()

    def add_gpu_report(self, report: GpuReport) -> None:
        if len(self._pending) >= MAX_QUEUED_REPORTS:
            dropped = self._pending.pop(0)
            log.error("too many unsent GPU reports: dropping the oldest (%s)", dropped)
        self._pending.append(report)
        self.trigger()

    def silence(self) -> None:
        """Send nothing more: the node is going down (injected node_down)."""
        self._silenced = True

    # --- the task -------------------------------------------------------------------------

    async def run(self) -> None:
        # Short timeouts: a heartbeat stuck for longer than a period is worth less than
        # the next one.
        timeout = httpx.Timeout(min(max(self.period_s, 1.0), 5.0), connect=1.0)
        # One connection to the supervisor, and one to the relay if any.
        connections = 1 if self.relay_url is None else 2
        limits = httpx.Limits(
            max_connections=connections,
            max_keepalive_connections=connections,
            keepalive_expiry=CLIENT_KEEP_ALIVE_S,
        )
        mirroring = [
            asyncio.create_task(m.run(timeout), name=f"heartbeat-mirror:{m.url}")
            for m in self.mirrors
        ]
        try:
            async with httpx.AsyncClient(
                timeout=timeout, limits=limits, verify=self._ssl
            ) as client:
                while not self._silenced:
                    self._wake.clear()
                    ok = await self._send(client)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), self._delay(ok))
        finally:
            for task in mirroring:
                task.cancel()
            await asyncio.gather(*mirroring, return_exceptions=True)

    def _delay(self, ok: bool) -> float:
        if ok:
            return self.period_s * random.uniform(1 - JITTER, 1 + JITTER)
        # Backoff: period/20, doubling per failure, capped at the period; "equal jitter"
        # (half fixed, half random) keeps the growth and spreads a fleet's retries.
        base = max(self.period_s / 20, 0.01)
        return attempt_delay(base, self._failures, self.period_s, jitter=random.random)

    def body(self, snap: NodeSnapshot | None = None) -> HostHeartbeat:
        if snap is None:
            snap = self._snapshot()
        spare = snap.state is NodeState.SPARE
        body = HostHeartbeat(
            node=self.node,
            state=snap.state,
            job=None if spare else snap.job,
            workers=[] if spare else snap.workers,
            gpu_reports=list(self._pending),
            address=self.address,
            unreachable_peers=self._unreachable_peers() if self._unreachable_peers else [],
        )
        check_heartbeat(body)  # what the supervisor would refuse, refused here
        return body

    async def _send(self, client: httpx.AsyncClient) -> bool:
        if self._silenced:
            return False
        try:
            snap = self._snapshot()
            body = self.body(snap)
        except ValueError as exc:  # a bug of ours; say it, do not spin on it
            self._problem(f"cannot build a heartbeat: {exc}", level=logging.ERROR)
            self._failures += 1
            self.failed_total += 1
            return False
        sent = len(body.gpu_reports)
        urgent, self._urgent = self._urgent, False
        content = msgspec.json.encode(body)
        for mirror in self.mirrors:
            mirror.offer(content)
        try:
            headers = {
                "Authorization": self._credential.header(),
                "Content-Type": "application/json",
            }
            if urgent:
                headers[URGENT_HEADER] = "1"
            response = await self._post(client, content, headers)
        except CredentialError as exc:
            self._failed(str(exc))
            return False
        except httpx.HTTPError as exc:
            if isinstance(exc, httpx.ConnectError) and _refused(exc):
                self.last_answered = time.monotonic()
            self._failed(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            return False
        if self._silenced:
            return False
        self.last_answered = time.monotonic()
        if response.is_success:
            del self._pending[:sent]  # reports queued meanwhile stay for the next one
            if self._failures:
                log.info(
                    "heartbeat delivered to %s after %d failed attempt(s)",
                    self.url,
                    self._failures,
                )
            self._failures = 0
            self._last_problem = None
            self.delivered += 1
            self.last_delivered_unix_s = time.time()
            world = job_world_of(response.headers.get(JOB_WORLD_HEADER))
            if world is not None and body.job is not None and self.on_job_world is not None:
                self.on_job_world(body.job, world)
            if self._on_delivered is not None:
                self._on_delivered(snap)
            return True
        detail = error_message(response)
        if response.status_code == 409:
            stale = stale_world_of(response.content)
            if stale is not None:
                self.stale_worlds += 1
                log.warning("supervisor refused workers of an older world: %s", stale.message)
                if self.on_job_world is not None:
                    self.on_job_world(stale.job, stale.world)
                if self._on_stale_world is not None:
                    self._on_stale_world(stale)
        if response.status_code == 401:
            self._credential.refresh()  # rotated meanwhile: read it again
        if response.status_code == 422 and sent:
            # The supervisor refuses these reports; keeping them would block every
            # heartbeat after this one, and a node without heartbeats is declared lost.
            del self._pending[:sent]
            log.error("supervisor rejected %d GPU report(s), dropped: %s", sent, detail)
        self._failed(f"HTTP {response.status_code}: {detail}")
        return False

    async def _post(
        self, client: httpx.AsyncClient, content: bytes, headers: dict[str, str]
    ) -> httpx.Response:
        """The supervisor's answer to the heartbeat: through the relay if one is set and
        it answers for the supervisor, else directly."""
        if self.relay_url is not None:
            try:
                response = await client.post(self.relay_url, content=content, headers=headers)
            except httpx.HTTPError as exc:
                problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            else:
                if response.status_code != RELAY_UPSTREAM_FAILED:
                    self.relayed += 1
                    self._relay_problem = None
                    return response
                problem = f"HTTP {response.status_code}: {error_message(response)}"
            if problem != self._relay_problem:
                log.warning(
                    "heartbeat relay %s failed (%s); sending directly", self.relay_url, problem
                )
                self._relay_problem = problem
        return await client.post(self.url, content=content, headers=headers)

    def heard_s(self) -> float | None:
        """Seconds since the supervisor last answered; None until it accepted a heartbeat
        (a supervisor still starting stops no worker: their lease is not armed yet)."""
        answered = self.last_answered
        if answered is None or not self.delivered:
            return None
        return time.monotonic() - answered

    @property
    def failing_in_a_row(self) -> int:
        return self._failures

    def _failed(self, problem: str) -> None:
        self._failures += 1
        self.failed_total += 1
        self._problem(problem)

    def _problem(self, problem: str, level: int = logging.WARNING) -> None:
        # Once per distinct problem, not once per retry: a down supervisor is one line.
        if problem != self._last_problem:
            log.log(level, "heartbeat to %s failed (%s); retrying with backoff", self.url, problem)
            self._last_problem = problem
        else:
            log.debug("heartbeat to %s failed again (%s)", self.url, problem)


def _refused(exc: BaseException) -> bool:
    """Whether the connection was refused (ECONNREFUSED anywhere in its causes)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError) or "Connection refused" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class HeartbeatMirror:
    """Sends copies of the heartbeats to a dry-run supervisor shadowing the acting one.

    Best effort, on its own task and connection: only the newest heartbeat waits (one
    that was not sent yet is replaced by the next), a failure is logged once per distinct
    problem and not retried, and nothing here can delay or fail the acting supervisor's
    heartbeat.
    """

    def __init__(
        self, base_url: str, credential: BearerCredential, ssl_context: ssl.SSLContext
    ) -> None:
        self.url = base_url.rstrip("/") + HEARTBEAT_PATH
        self._credential = credential
        self._ssl = ssl_context
        self._latest: bytes | None = None
        self._ready = asyncio.Event()
        self.delivered = 0
        self._last_problem: str | None = None

    def offer(self, content: bytes) -> None:
        self._latest = content
        self._ready.set()

    async def run(self, timeout: httpx.Timeout) -> None:
        limits = httpx.Limits(
            max_connections=1, max_keepalive_connections=1, keepalive_expiry=CLIENT_KEEP_ALIVE_S
        )
        async with httpx.AsyncClient(timeout=timeout, limits=limits, verify=self._ssl) as client:
            while True:
                await self._ready.wait()
                self._ready.clear()
                content, self._latest = self._latest, None
                if content is not None:
                    await self._send(client, content)

    async def _send(self, client: httpx.AsyncClient, content: bytes) -> None:
        try:
            headers = {
                "Authorization": self._credential.header(),
                "Content-Type": "application/json",
            }
            response = await client.post(self.url, content=content, headers=headers)
        except (CredentialError, httpx.HTTPError) as exc:
            self._problem(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            return
        if response.is_success:
            self.delivered += 1
            self._last_problem = None
            return
        self._problem(f"HTTP {response.status_code}: {error_message(response)}")

    def _problem(self, problem: str) -> None:
        if problem != self._last_problem:
            log.warning("heartbeat copy to shadow %s failed (%s)", self.url, problem)
            self._last_problem = problem
