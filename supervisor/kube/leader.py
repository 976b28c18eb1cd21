"""Leader election with a `coordination.k8s.io/v1` Lease: one replica acts, the others wait.

The algorithm is client-go's (`k8s.io/client-go/tools/leaderelection`, as used by
kube-controller-manager and kube-scheduler):

- Every `retry_period` a candidate reads the Lease. If nobody holds it, if it is ours, or
  if it has expired, the candidate writes itself in as holder, sending the
  resourceVersion it read: a 409 Conflict means another replica wrote first, and this
  round is lost.
- Expiry is judged on this replica's own monotonic clock: a Lease held by another
  replica expires when its record has not changed for `leaseDurationSeconds` since
  *we saw it change*. `renewTime` is written for people and tools; it is never compared
  with our wall clock, because the clocks of two machines differ.
- The leader renews every `retry_period`. It has lost the Lease when no renewal
  succeeded within `renew_deadline` of the start of the last good one, when it reads
  another holder (the Lease was taken), or when the Lease is gone (deleted). As
  `renew_deadline < lease_duration`, a leader that cannot renew gives up before anyone
  may take over, with `lease_duration - renew_deadline` to spare.

Fencing: a leader may act only while its last renewal started less than
`renew_deadline` ago (`LeaderElector.check`). Every action attempt and every call the
backends make checks it first, so a replica that was frozen for longer than the Lease
lasts, and wakes up with work ready to run, steps down before sending anything instead
of racing the new leader.

What losing means here is `Leadership`'s business: the replica exits at once (non-zero,
so Kubernetes restarts it, as a standby), which stops every task of the runtime without
having to trust that each one notices a flag.

Why not `kubernetes.leaderelection` (client 37): it runs in threads with callbacks,
times expiry and the renew deadline with `time.time()` (a wall-clock step can make two
leaders), writes naive local-time `renewTime`s and calls `sys.exit` on bad arguments.

Layout: lease.py is one replica's side of the Lease (`LeaderElector`: the rounds, the
renewals, `check`, the release); this module runs the supervisor on it (`Leadership`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Protocol

from kubernetes import client

from supervisor.actuator import Fence, Fenced
from supervisor.kube.client import ClientSettings, api_client
from supervisor.kube.lease import (
    JITTER,
    ElectionConfig,
    ElectionSettings,
    LeaderElector,
    LeadershipLost,
    micro_time,
)

# The election's names, importable from here as before the Lease's side moved to lease.py.
__all__ = [
    "EXIT_LEADERSHIP_LOST",
    "JITTER",
    "ElectionConfig",
    "LeaderElector",
    "LeaderRuntime",
    "Leadership",
    "LeadershipLost",
    "OnLost",
    "exit_process",
    "micro_time",
]

log = logging.getLogger(__name__)

#: Exit status of a replica that lost the Lease (sysexits' EX_TEMPFAIL: try again later).
EXIT_LEADERSHIP_LOST = 75


class LeadershipSettings(ElectionSettings, ClientSettings, Protocol):
    """The election's settings and where the API server is."""


class LeaderRuntime(Protocol):
    """What leadership needs of the runtime it runs (supervisor.runtime.Supervisor): it
    starts and stops it, fences its actions, and says what its readiness answers while
    it waits or once it lost the Lease."""

    def set_fence(self, fence: Fence) -> None:
        """Before `start`: every action and backend call checks `fence` first."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def stand_by(self, identity: str, leader: str | None, detail: str) -> None:
        """Not ready: this replica (`identity`) waits while `leader` (None: nobody yet)
        leads."""
        ...

    def step_down(self, reason: str) -> None:
        """Lost the Lease: refuse requests and stop counting as the acting replica, at
        once."""
        ...


OnLost = Callable[[str], None]


def exit_process(reason: str) -> None:
    """Stop acting at once: leave without unwinding anything that might still act."""
    log.critical(
        "lost leadership: %s; exiting (status %d) so that no action runs twice",
        reason,
        EXIT_LEADERSHIP_LOST,
    )
    logging.shutdown()
    os._exit(EXIT_LEADERSHIP_LOST)


class Leadership:
    """Runs the supervisor only while this replica holds the Lease.

    A standby serves HTTP but is not ready (the runtime's readiness says who leads), so
    the Service sends heartbeats and requests to the leader. On winning the Lease the
    runtime starts, which takes back the picture, unfinished actions and unhandled
    events from the database. On losing it, `on_lost` is called: by default the process
    exits.
    """

    def __init__(
        self,
        settings: LeadershipSettings,
        supervisor: LeaderRuntime,
        *,
        api: client.ApiClient | None = None,
        on_lost: OnLost = exit_process,
    ) -> None:
        self._api = api or api_client(settings)
        self.elector = LeaderElector(
            client.CoordinationV1Api(self._api), ElectionConfig.from_settings(settings)
        )
        self.supervisor = supervisor
        supervisor.set_fence(self.fence)
        #: Why this replica lost the Lease, once it has.
        self.lost: str | None = None
        self._on_lost = on_lost
        self._campaign: asyncio.Task[None] | None = None
        self._renewal: asyncio.Task[None] | None = None
        self._shown: tuple[str, str | None] | None = None

    async def start(self) -> None:
        """Start campaigning; returns at once (a standby serves HTTP meanwhile)."""
        self._show_standby()
        self._campaign = asyncio.create_task(self._run(), name="leader-election")

    async def _run(self) -> None:
        try:
            await self.elector.acquire(self._show_standby)
            log.info("this replica (%s) leads: starting the supervisor", self.elector.identity)
            self._renewal = asyncio.create_task(self._hold(), name="leader-renewal")
            await self.supervisor.start()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Whatever ran of the runtime must not outlive this: same exit as a loss.
            log.exception("leader election or start failed")
            self._lost(f"{type(exc).__name__}: {exc}")

    async def _hold(self) -> None:
        try:
            await self.elector.hold()
        except LeadershipLost as exc:
            self._lost(str(exc))
        except Exception as exc:
            # Renewal can no longer be trusted; acting on would outlive the Lease.
            log.exception("Lease renewal failed")
            self._lost(f"renewal failed: {type(exc).__name__}: {exc}")

    def fence(self) -> None:
        """The runtime's fence: raises Fenced (after stepping down) once the Lease may
        be someone else's, so no action or Kubernetes call outlives the leadership."""
        if self.lost is not None:
            raise Fenced(self.lost)
        try:
            self.elector.check()
        except LeadershipLost as exc:
            self._lost(str(exc))
            raise Fenced(str(exc)) from None

    def _lost(self, reason: str) -> None:
        if self.lost is not None:
            return  # told once
        self.lost = reason
        self.supervisor.step_down(reason)  # refuse requests from now on
        self._on_lost(reason)

    def _show_standby(self) -> None:
        me, leader = self.elector.identity, self.elector.leader
        if self._shown == (me, leader):
            return
        self._shown = (me, leader)
        who = f"the leader is {leader}" if leader else "no leader yet (an election is on)"
        self.supervisor.stand_by(
            me,
            leader,
            f"this replica ({me}) is a standby; {who}. Only the leader serves the "
            "API: send requests to the Service, which routes to the ready replica",
        )
        log.info("standby: %s", who)

    async def stop(self) -> None:
        """Graceful shutdown: stop the runtime while still renewing, then release the
        Lease so that a standby takes over within a retry period."""
        if self._campaign is not None:
            self._campaign.cancel()
            await asyncio.gather(self._campaign, return_exceptions=True)
        await self.supervisor.stop()
        if self._renewal is not None:
            self._renewal.cancel()
            await asyncio.gather(self._renewal, return_exceptions=True)
        await self.elector.release()
        await asyncio.to_thread(self._api.close)
