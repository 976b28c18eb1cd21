"""Kubernetes-side sensing: what the watches show that heartbeats cannot.

- a pod of a supervised JobSet terminating for longer than `pod_termination_threshold_s`
  -> `pod_stuck_terminating`;
- a JobSet not fully running (fewer running pods than its replicated jobs ask for) for
  longer than `jobset_downtime_threshold_s` -> `workload_down`, saying how many of its
  pods are pending because no node fits them;
- a node whose Ready condition turns False or Unknown -> `node_not_ready`.

One event per episode: an episode ends when the pod is gone, the JobSet is fully running
again, the node is Ready again. Timers run on the event loop; the watches' changes start
and end episodes (nothing is polled).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from supervisor.config_parts import KubernetesSettings
from supervisor.domain import Event, EventType, utcnow
from supervisor.event_details import EVENT_DETAILS
from supervisor.kube import objects as o
from supervisor.kube.discovery import Discovery
from supervisor.kube.objects import Obj

log = logging.getLogger(__name__)

RaiseEvents = Callable[[list[Event]], None]


#: How often a JobSet seen before the pods' first list is looked at again.
UNLISTED_RECHECK_S = 0.2


class KubeSensing:
    def __init__(
        self, discovery: Discovery, settings: KubernetesSettings, raise_events: RaiseEvents
    ) -> None:
        self.discovery = discovery
        self.settings = settings
        self._raise = raise_events
        self._timers: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self._reported: set[tuple[str, str]] = set()
        self._down_since: dict[str, float] = {}
        self._dirty: set[str] = set()

    def start(self) -> None:
        self.discovery.listeners.append(self._on_change)

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    # --- dispatch -----------------------------------------------------------------------

    def _on_change(self, kind: str, type_: str, obj: Obj, before: Obj | None) -> None:
        if kind == "Pod":
            self._pod_changed(type_, obj, before)
            if (js := o.jobset_of(obj)) is not None:
                self._mark(js)
        elif kind == "JobSet":
            self._mark(o.name_of(obj))
        elif kind == "Node":
            self._node_changed(type_, obj, before)

    def _mark(self, jobset: str) -> None:
        """Check the JobSet once after this burst of changes (a re-list is one per pod)."""
        if not self._dirty:
            asyncio.get_running_loop().call_soon(self._check_dirty)
        self._dirty.add(jobset)

    def _check_dirty(self) -> None:
        dirty, self._dirty = self._dirty, set()
        for name in sorted(dirty):
            self._check_jobset(name)

    def _emit(self, event: Event) -> None:
        # Through the type's model: a field it does not declare cannot be emitted.
        event = replace(event, details=EVENT_DETAILS[event.type](**event.details).mapping())
        log.info(
            "kubernetes: %s node=%s job=%s %s",
            event.type.value,
            event.node,
            event.job,
            dict(event.details),
        )
        self._raise([event])

    def _arm(self, key: tuple[str, str], delay: float, callback: Callable[[], None]) -> None:
        if key in self._timers:
            return
        loop = asyncio.get_running_loop()
        self._timers[key] = loop.call_later(max(0.0, delay), self._fire, key, callback)

    def _fire(self, key: tuple[str, str], callback: Callable[[], None]) -> None:
        self._timers.pop(key, None)
        try:
            callback()
        except Exception:
            log.exception("kubernetes sensing failed on %s", key)

    def _end(self, key: tuple[str, str]) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        self._reported.discard(key)

    # --- pods stuck terminating -------------------------------------------------------------

    def _pod_changed(self, type_: str, pod: Obj, before: Obj | None) -> None:
        key = ("pod", o.uid_of(pod))
        if type_ == "DELETED" or not o.terminating(pod):
            self._end(key)
            return
        if key in self._reported or o.jobset_of(pod) not in self.discovery.jobsets():
            return
        since = o.terminating_since(pod) or datetime.now(UTC)
        if before is not None and not o.terminating(before):
            # Seen turning terminating just now: more precise than the API's timestamps,
            # which have a resolution of one second.
            since = max(since, datetime.now(UTC))
        age = time.time() - since.timestamp()
        threshold = self.settings.pod_termination_threshold_s
        self._arm(key, threshold - age, lambda: self._pod_stuck(o.key_of(pod), key))

    def _pod_stuck(self, cache_key: str, key: tuple[str, str]) -> None:
        pod = self.discovery.informers["Pod"].items.get(cache_key)
        if pod is None or o.uid_of(pod) != key[1] or not o.terminating(pod):
            return
        since = o.terminating_since(pod)
        m = pod["metadata"]
        self._reported.add(key)
        self._emit(
            Event(
                type=EventType.POD_STUCK_TERMINATING,
                time=utcnow(),
                node=o.node_of(pod),
                job=o.jobset_of(pod),
                details={
                    "pod": m["name"],
                    "namespace": m.get("namespace"),
                    "uid": m.get("uid"),
                    "terminating_since": since.isoformat() if since else None,
                    "terminating_for_s": round(time.time() - since.timestamp(), 1)
                    if since
                    else None,
                    "grace_period_s": m.get("deletionGracePeriodSeconds"),
                    "finalizers": list(m.get("finalizers") or []),
                    "threshold_s": self.settings.pod_termination_threshold_s,
                },
            )
        )

    # --- JobSets not fully running --------------------------------------------------------------

    def jobset_health(self, name: str) -> dict[str, Any] | None:
        """None when the JobSet is fully running (or finished, suspended, unknown); else
        what is missing."""
        js = self.discovery.jobset(name)
        if js is None or o.jobset_finished(js) or o.jobset_suspended(js):
            return None
        pods = [p for p in self.discovery.pods_of(name) if not o.pod_finished(p)]
        expected = o.expected_pods(js)
        running = [p for p in pods if o.pod_running(p)]
        if len(running) >= expected:
            return None
        unschedulable = [p for p in pods if o.pod_unschedulable(p)]
        details: dict[str, Any] = {
            "expected_pods": expected,
            "running_pods": len(running),
            "pending_pods": sum(1 for p in pods if p.get("status", {}).get("phase") == "Pending"),
            "terminating_pods": sum(1 for p in pods if o.terminating(p)),
            "unschedulable_pods": len(unschedulable),
            "restarts": js.get("status", {}).get("restarts", 0),
        }
        if unschedulable:
            c = o.condition(unschedulable[0], "PodScheduled") or {}
            details["scheduler_message"] = c.get("message")
        return details

    def _check_jobset(self, name: str) -> None:
        key = ("jobset", name)
        pods = self.discovery.informers.get("Pod")
        if pods is not None and not pods.synced.is_set():
            # Its pods are not known yet, not missing: judged once their first list is in
            # (a JobSet listed first, on a loaded machine, was reported down with none).
            self._arm(
                ("jobset-unlisted", name), UNLISTED_RECHECK_S, lambda: self._check_jobset(name)
            )
            return
        if self.jobset_health(name) is None:
            self._down_since.pop(name, None)
            self._end(key)
            return
        if key in self._reported:
            return
        since = self._down_since.setdefault(name, time.monotonic())
        left = self.settings.jobset_downtime_threshold_s - (time.monotonic() - since)
        self._arm(key, left, lambda: self._jobset_down(name, key))

    def _jobset_down(self, name: str, key: tuple[str, str]) -> None:
        details = self.jobset_health(name)
        if details is None:
            return
        since = self._down_since.get(name, time.monotonic())
        details["down_for_s"] = round(time.monotonic() - since, 1)
        details["threshold_s"] = self.settings.jobset_downtime_threshold_s
        self._reported.add(key)
        self._emit(Event(type=EventType.WORKLOAD_DOWN, time=utcnow(), job=name, details=details))

    # --- nodes turning NotReady --------------------------------------------------------------

    def _node_changed(self, type_: str, node: Obj, before: Obj | None) -> None:
        name = o.name_of(node)
        key = ("node", name)
        if type_ == "DELETED" or o.node_ready(node):
            self._end(key)
            return
        if key in self._reported:
            return
        if before is None:
            # First sight (a start or a re-list): only a node that still runs our workload
            # and that we have not swapped out yet is news.
            if self.discovery.jobset_on(name) is None or o.has_taint(
                node, self.settings.kube_taint_key
            ):
                return
        elif not o.node_ready(before):
            return  # NotReady before: the episode was reported, or began unseen
        c = o.condition(node, "Ready") or {}
        self._reported.add(key)
        self._emit(
            Event(
                type=EventType.NODE_NOT_READY,
                time=utcnow(),
                node=name,
                job=self.discovery.jobset_on(name),
                details={
                    "status": c.get("status", "Unknown"),
                    "reason": c.get("reason"),
                    "message": c.get("message"),
                    "since": c.get("lastTransitionTime"),
                },
            )
        )
