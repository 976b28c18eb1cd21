"""Kubernetes Events (core/v1) about what the supervisor did, so `kubectl describe` of a
JobSet, pod or node shows each action, its id and why.

An event's name is derived from the action's idempotency key and the object, so an
action repeated after a crash creates it once (the second create is 409 AlreadyExists).
Failing to record an event never fails the action it describes: it is logged.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from kubernetes import client

from supervisor.kube.calls import Calls
from supervisor.kube.errors import Conflict, KubeError, NotFound
from supervisor.kube.objects import COMPONENT, Obj, rfc3339

log = logging.getLogger(__name__)

#: Where events about cluster-scoped objects (nodes) go, as kubectl looks for them.
NODE_EVENT_NAMESPACE = "default"


class EventRecorder:
    def __init__(self, api: client.ApiClient, calls: Calls, *, host: str = "") -> None:
        self._core = client.CoreV1Api(api)
        self._calls = calls
        self._host = host

    async def record(
        self,
        obj: Obj,
        *,
        kind: str,
        api_version: str,
        key: str,
        reason: str,
        message: str,
        warning: bool = False,
        annotations: dict[str, str] | None = None,
    ) -> bool:
        """Create the event; False (logged) when it could not be."""
        m = obj.get("metadata", {})
        name, namespace = str(m.get("name", "")), m.get("namespace")
        involved: dict[str, Any] = {
            "kind": kind,
            "apiVersion": api_version,
            "name": name,
            "uid": m.get("uid"),
            "resourceVersion": m.get("resourceVersion"),
        }
        if namespace:
            involved["namespace"] = namespace
        now = rfc3339()
        event_ns = namespace or NODE_EVENT_NAMESPACE
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": event_name(kind, name, key, reason),
                "namespace": event_ns,
                "annotations": annotations or {},
            },
            "involvedObject": involved,
            "reason": reason,
            "message": message[:1024],
            "type": "Warning" if warning else "Normal",
            "source": {"component": COMPONENT, **({"host": self._host} if self._host else {})},
            "reportingComponent": COMPONENT,
            "reportingInstance": self._host or COMPONENT,
            "action": reason,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self._calls.run(
                f"create event {reason} on {kind} {name}",
                self._core.create_namespaced_event,
                event_ns,
                body,
            )
        except Conflict:
            return True  # this action already recorded it (a repeat after a crash)
        except KubeError as exc:
            log.warning("could not record event %s on %s %s: %s", reason, kind, name, exc)
            return False
        return True

    async def annotations(self, namespace: str, name: str) -> dict[str, str] | None:
        """The annotations of an event we recorded (None if there is no such event)."""
        try:
            response = await self._calls.run(
                f"get event {name}",
                self._core.read_namespaced_event,
                name,
                namespace,
                _preload_content=False,
            )
        except NotFound:
            return None
        body = json.loads(response.data)
        return dict(body.get("metadata", {}).get("annotations") or {})


def event_name(kind: str, name: str, key: str, reason: str) -> str:
    """Derived from the action's key: a repeated action finds (and does not duplicate) it."""
    digest = hashlib.sha1(f"{key}|{kind}|{name}|{reason}".encode()).hexdigest()[:16]
    return f"{name}.{digest}"
