"""Turns heartbeats and GPU reports into events. Knows nothing of Kubernetes or SQL.

`Sensor` (sensor.py) is the whole of it to the rest of the supervisor; its module says
which part lives where.
"""

from resiliency_protocol.heartbeat import GpuReport, HostHeartbeat, WorkerReport
from supervisor.sensor.sensor import Changes, Sensor

__all__ = ["Changes", "GpuReport", "HostHeartbeat", "Sensor", "WorkerReport"]
