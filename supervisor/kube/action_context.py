"""What every action family works with: the API, the watches' cache, the settings and the
supervisor's hooks, in one small object the backend builds once."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

import httpx
from kubernetes import client

from supervisor.actuator.backend import ActionError, BackendHooks
from supervisor.config import Settings
from supervisor.domain import ActionRecord
from supervisor.kube import objects as o
from supervisor.kube.calls import Calls
from supervisor.kube.discovery import Discovery
from supervisor.kube.events import EventRecorder
from supervisor.kube.generations import reference_time


@dataclass(slots=True, kw_only=True)
class ActionContext:
    settings: Settings
    calls: Calls
    core: client.CoreV1Api
    batch: client.BatchV1Api
    custom: client.CustomObjectsApi
    discovery: Discovery
    events: EventRecorder
    #: To the host monitors (emergency checkpoints); carries the actuator token.
    http: httpx.AsyncClient
    #: How long an eviction refused by a PodDisruptionBudget (429) is retried before
    #: the pod is deleted instead.
    eviction_patience_s: float
    #: How long a restart waits for the Job and JobSet controllers to react to pods
    #: or Jobs of its generation that have failed (they restart the JobSet
    #: themselves), before it acts, or fails for want of anything to act on.
    controller_patience_s: float
    #: The supervisor's, from `KubeBackend.start` on.
    hooks: BackendHooks | None = None
    #: JobSets told (an event) to take no emergency checkpoints: told once, not at every fault.
    told_no_emergency: set[str] = field(default_factory=set)

    @property
    def ns(self) -> str:
        return self.settings.kube_namespace

    async def reference_time(self, action: ActionRecord) -> datetime:
        """What a disruptive action is decided against: its event's reference time (see
        `generations.reference_time`), else its own creation (an operator's request)."""
        hooks = self.hooks
        if action.event_id is not None and hooks is not None and hooks.event is not None:
            try:
                event = await hooks.event(action.event_id)
            except Exception as exc:  # the store is down: try again later
                raise ActionError(
                    f"cannot read event {action.event_id}: {exc}", retryable=True
                ) from exc
            if event is not None:
                return reference_time(event, self.settings.heartbeat_polling_period_s)
        return action.created_at

    def host_monitor_url(self, node: str) -> str | None:
        """Where the node's host monitor answers: the address its heartbeats give, else
        the node's internal IP on the configured port."""
        if self.hooks is not None and (address := self.hooks.node_address(node)):
            return address.rstrip("/")
        obj = self.discovery.node(node)
        ip = o.internal_ip(obj) if obj else None
        if ip is None:
            return None
        host = f"[{ip}]" if ":" in ip else ip
        return f"{self.settings.host_monitor_scheme}://{host}:{self.settings.host_monitor_port}"


class Heal(Protocol):
    """In-process healing (`in_process.InProcessHealing.heal`), handed to the plain
    restart in place and hot swap: its result, or None where the JobSet does not heal
    in-process."""

    async def __call__(self, action: ActionRecord, *, swap: bool) -> dict[str, Any] | None: ...


def jobset_name(action: ActionRecord) -> str:
    if not action.job:
        raise ActionError(f"{action.type.value} needs a job (a JobSet name)")
    return action.job


def node_name(action: ActionRecord) -> str:
    if not action.node:
        raise ActionError(f"{action.type.value} needs a node")
    return action.node
