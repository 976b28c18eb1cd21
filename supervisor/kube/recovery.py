"""Gives swapped-out nodes back: a node carrying our taint that has been healthy (Ready,
and heartbeating when a host monitor runs on it) for `node_recovery_healthy_s` gets an
`uncordon` action, recorded and carried out like any other (the backend then removes
the taint and sets the health label back to Schedulable). Once the node is schedulable
again, a `node_recovered` event tells the policy there is capacity back (the default
policy scales jobs up with it).

Readiness comes from the node watch; heartbeats from the supervisor's sensor, which is
in memory, so this checks both every few seconds rather than on changes only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from supervisor.config_parts import KubernetesSettings
from supervisor.domain import ActionRequest, ActionType, Event, EventType, utcnow
from supervisor.event_details import NodeRecoveredDetails
from supervisor.kube import objects as o
from supervisor.kube.discovery import Discovery

log = logging.getLogger(__name__)

RequestAction = Callable[[ActionRequest, str], Awaitable[None]]
Heartbeating = Callable[[str], bool | None]
RaiseEvents = Callable[[list[Event]], None]


class NodeRecovery:
    def __init__(
        self,
        discovery: Discovery,
        settings: KubernetesSettings,
        request_action: RequestAction,
        heartbeating: Heartbeating,
        raise_events: RaiseEvents,
    ) -> None:
        self.discovery = discovery
        self.settings = settings
        self._request = request_action
        self._heartbeating = heartbeating
        self._raise = raise_events
        #: Nodes whose uncordon was asked for, by name: the action's key.
        self._restoring: dict[str, str] = {}
        self._healthy_since: dict[str, float] = {}
        self._requested: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self.period_s = max(0.05, min(5.0, settings.node_recovery_healthy_s / 4))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kube-node-recovery")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                await self.check()
            except Exception:
                log.exception("node recovery check failed")

    def healthy(self, name: str) -> bool:
        node = self.discovery.node(name)
        return node is not None and o.node_ready(node) and self._heartbeating(name) is not False

    async def check(self) -> None:
        now = time.monotonic()
        taint_key = self.settings.kube_taint_key
        for name, node in self.discovery.nodes().items():
            if name in self._restoring and not o.has_taint(node, taint_key):
                if o.node_schedulable(node):
                    key = self._restoring.pop(name)
                    self._raise(
                        [
                            Event(
                                EventType.NODE_RECOVERED,
                                utcnow(),
                                node=name,
                                details=NodeRecoveredDetails(
                                    source="kubernetes", uncordoned_by=key
                                ).mapping(),
                            )
                        ]
                    )
                continue
            taint = next(
                (t for t in node.get("spec", {}).get("taints") or [] if t.get("key") == taint_key),
                None,
            )
            if taint is None or not self.healthy(name):
                self._healthy_since.pop(name, None)
                continue
            since = self._healthy_since.setdefault(name, now)
            if now - since < self.settings.node_recovery_healthy_s:
                continue
            # One uncordon per swap-out: the taint's timestamp names the episode.
            key = f"kube-recover-{name}-{taint.get('timeAdded') or o.uid_of(node)}"
            if key in self._requested:
                continue
            self._requested.add(key)
            self._restoring[name] = key
            request = ActionRequest(
                ActionType.UNCORDON,
                node=name,
                reason=f"node {name} Ready and heartbeating for"
                f" {now - since:.0f}s >= node_recovery_healthy_s="
                f"{self.settings.node_recovery_healthy_s:g}",
            )
            await self._request(request, key)
