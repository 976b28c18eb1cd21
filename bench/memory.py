"""Memory per tracked node: what a Sensor keeps for each node, measured with tracemalloc.

Heartbeats are parsed from JSON one at a time and handed to the sensor with their body,
as the service does, so only what the sensor retains is counted (node record, the last
heartbeat's body or worker reports, deadline entries, job progress).
"""

from __future__ import annotations

import gc
import tracemalloc
from dataclasses import dataclass

from bench.loops import run as run_loop
from bench.payload import heartbeat_json
from resiliency_protocol.heartbeat import decode_heartbeat
from supervisor.config import Settings
from supervisor.sensor import Sensor


@dataclass(frozen=True, slots=True)
class MemoryResult:
    nodes: int
    bytes_per_node: float
    json_bytes: int  # one heartbeat as compact JSON, the baseline


async def _measure(nodes: int, heartbeats_each: int) -> MemoryResult:
    settings = Settings(
        heartbeat_timeout_s=600,
        heartbeat_polling_period_s=300,
        agent_token="bench-agent-token",
        operator_token="bench-operator-token",
    )
    sensor = Sensor(settings.sensing, settings.workload, lambda _: None)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for step in range(1, heartbeats_each + 1):
            for i in range(nodes):
                body = heartbeat_json(i, step)
                sensor.ingest(decode_heartbeat(body), body)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
        sensor.close()
    assert len(sensor.node_names()) == nodes
    return MemoryResult(
        nodes=nodes,
        bytes_per_node=(after - before) / nodes,
        json_bytes=len(heartbeat_json(nodes - 1, heartbeats_each)),
    )


def run(nodes: int = 10_000, heartbeats_each: int = 2) -> MemoryResult:
    gc.collect()
    return run_loop(_measure(nodes, heartbeats_each))
