"""A node's GPU reports (an XID, a health check, an ECC count) turned into events.

A report that repeats one of the node's within `gpu_report_cooldown_s` raises nothing
(it is counted as suppressed); an ECC count raises an event only when it grew.
"""

from __future__ import annotations

from resiliency_protocol.heartbeat import GPU_XID, GpuReport
from supervisor.config_parts import SensingSettings
from supervisor.domain import Event, EventType, utcnow
from supervisor.metrics import Metrics
from supervisor.sensor.events import NodeEvents
from supervisor.sensor.nodes import NodeRecord
from supervisor.xid import HEALTH, classify


class GpuReports:
    def __init__(self, settings: SensingSettings, metrics: Metrics, events: NodeEvents) -> None:
        self.settings = settings
        self.metrics = metrics
        self._events = events

    def event(
        self, node: NodeRecord, report: GpuReport, now: float, fault_id: int | None
    ) -> Event | None:
        """The event the node's report raises, if any; `fault_id`: an injected fault's."""
        observed = (report.time or utcnow()).isoformat()
        event = self._events.event
        if report.kind == GPU_XID:
            if self._repeated(node, (GPU_XID, report.gpu, report.code), now, EventType.GPU_XID):
                return None
            xid = classify(report.code, self.settings.xid_responses)
            return event(
                EventType.GPU_XID,
                node,
                fault_id=fault_id,
                code=report.code,
                gpu=report.gpu,
                message=report.message,
                observed_at=observed,
                **xid.details(),
            )
        if report.kind in HEALTH:
            if self._repeated(node, (report.kind, report.gpu, None), now, EventType.GPU_HEALTH):
                return None
            return event(
                EventType.GPU_HEALTH,
                node,
                fault_id=fault_id,
                kind=report.kind,
                gpu=report.gpu,
                count=report.count,
                message=report.message,
                observed_at=observed,
                **HEALTH[report.kind].details(),
            )
        assert report.count is not None  # guaranteed by GpuReport's validator
        if node.ecc_counts is None:
            node.ecc_counts = {}
        before = node.ecc_counts.get(report.gpu, 0)
        node.ecc_counts[report.gpu] = report.count
        if report.count <= before:
            return None
        return event(
            EventType.GPU_ECC,
            node,
            fault_id=fault_id,
            gpu=report.gpu,
            count=report.count,
            new_errors=report.count - before,
            message=report.message,
            observed_at=observed,
        )

    def _repeated(
        self,
        node: NodeRecord,
        key: tuple[str, int | None, int | None],
        now: float,
        type_: EventType,
    ) -> bool:
        """Whether this GPU report repeats one of the node's within the cooldown (then it
        is counted as suppressed); else it is noted as the newest of its key."""
        if node.gpu_seen is None:
            node.gpu_seen = {}
        last = node.gpu_seen.get(key)
        if last is not None and now - last < self.settings.gpu_report_cooldown_s:
            self.metrics.events_suppressed.labels(type_.value).inc()
            return True
        node.gpu_seen[key] = now
        return False
