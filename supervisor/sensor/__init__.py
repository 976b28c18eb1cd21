"""Turns heartbeats and GPU reports into events. Knows nothing of Kubernetes or SQL."""

from resiliency_protocol.heartbeat import GpuReport, HostHeartbeat, WorkerReport
from supervisor.sensor.sensor import Changes, Sensor

__all__ = ["Changes", "GpuReport", "HostHeartbeat", "Sensor", "WorkerReport"]
